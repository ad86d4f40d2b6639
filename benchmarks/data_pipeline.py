"""Throughput of lmforge's quality filters and MinHash deduplication against datatrove's blocks.

Part 1, filters:
Both sides see the same prose documents (``lmforge.corpus.pystdlib``: module docstrings and the language
reference topics) in one process on one core, in the same run: first each filter alone over every
document, then the chain gopher_quality -> gopher_repetition -> c4 -> fineweb (a document stops at
the first filter that removes it; C4's line edits feed the next filter). Rounds alternate between the
two sides and the median time per round is reported, so drift in machine speed hits both alike.

datatrove's blocks are called directly (``block.filter(doc)``), without its pipeline and executor, so
the comparison is filter code against filter code. They are configured with lmforge's thresholds where
datatrove has the knob (C4: 5 words per line, 3 sentences, as C4's released filter; FineWeb: both run
datatrove's fourth "list ratio" rule at 0.3), so both do the same checks. datatrove splits words with
spaCy's blank English tokenizer (``pip install spacy``; no model download); without spaCy its Gopher
and C4 blocks cannot run and are reported as skipped.

Part 2, MinHash signatures and bucketing: ``benchmarks/minhash.py`` (see its docstring), run in the
same process after the filters (``--no-minhash`` skips it).

Part 3, the model-based stages on the same prose documents, one process: ``blocklist`` (the built-in
list), ``classifier`` (a model trained here on half of the documents against the same documents with
their words shuffled: a real model, trained in a second; what it learns does not matter for speed) and
``perplexity`` (the scoring pass, ``signatures`` in the groups the pipeline hands it, with the run given
by ``--reference-run``; without one, a 4-layer model is trained here for 30 steps on the built-in
corpus: the time per document depends on the model's size, not on its training). Each is timed on one
core (torch at one thread; the classifier's sparse products use one) and ``perplexity`` also with every
core; each figure is printed with its ratio to ``gopher_quality`` on the same documents in the same run
(``--no-model-stages`` skips part 3; ``--only-model-stages`` runs it alone, without datatrove).

    python benchmarks/data_pipeline.py [--docs 1000] [--rounds 3] [--no-minhash] [--reference-run RUN]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minhash import bench_minhash

from lmforge.corpus.document import Doc
from lmforge.corpus.executors import default_workers
from lmforge.corpus.pystdlib import read_pystdlib
from lmforge.corpus.stages.base import DocStage, run_doc_stages
from lmforge.corpus.stages.quality import (
    C4Filter,
    FineWebFilter,
    FineWebParams,
    GopherQuality,
    GopherRepetition,
)

FILTERS = ["gopher_quality", "gopher_repetition", "c4", "fineweb"]


def prose_documents(n: int) -> list[tuple[str, str]]:
    """The first ``n`` prose documents of the built-in corpus, as (id, text)."""
    prose = (d for d in read_pystdlib() if d.domain == "prose" and d.text.strip())
    return [(d.id, d.text) for d in itertools.islice(prose, n)]


def lmforge_filters() -> dict[str, DocStage]:
    return {
        "gopher_quality": GopherQuality(),
        "gopher_repetition": GopherRepetition(),
        "c4": C4Filter(),
        "fineweb": FineWebFilter(FineWebParams(max_newline_word_ratio=0.3)),
    }


def datatrove_filters() -> tuple[dict[str, Any], dict[str, str]]:
    """datatrove's blocks that can run here, and why the others cannot."""
    import datatrove.pipeline.filters as dt

    blocks = {
        "gopher_quality": dt.GopherQualityFilter(),
        "gopher_repetition": dt.GopherRepetitionFilter(),
        "c4": dt.C4QualityFilter(min_words_per_line=5, min_num_sentences=3),
        "fineweb": dt.FineWebQualityFilter(),
    }
    from datatrove.data import Document

    probe = Document(text="The cat sat on the mat. It was warm.\nThe dog slept by the door.", id="probe")
    usable, skipped = {}, {}
    for name, block in blocks.items():
        try:
            block.filter(copy.copy(probe))
            usable[name] = block
        except Exception as err:  # a missing tokenizer or a download datatrove would need
            skipped[name] = f"{type(err).__name__}: {err}"
    return usable, skipped


def run_lmforge(stages: list[DocStage], docs: list[Doc]) -> list[bool]:
    return [isinstance(out, Doc) for out in run_doc_stages(stages, docs)]


def run_datatrove(blocks: list[Any], docs: list[Any]) -> list[bool]:
    kept = []
    for doc in docs:
        ok = True
        for block in blocks:
            result = block.filter(doc)
            ok = result is True or (isinstance(result, bool) and result)
            if not ok:
                break
        kept.append(ok)
    return kept


def timed(fn: Callable[[], list[bool]]) -> tuple[float, list[bool]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def bench_filters(n_docs: int, rounds: int) -> dict[str, Any]:
    from datatrove.data import Document

    texts = prose_documents(n_docs)
    ours = lmforge_filters()
    theirs, skipped = datatrove_filters()

    def our_docs() -> list[Doc]:
        return [Doc(i, t, "prose") for i, t in texts]

    def their_docs() -> list[Any]:
        return [Document(text=t, id=i) for i, t in texts]

    # warm-up (imports, spaCy's tokenizer, regex compilation) on a few documents
    run_lmforge(list(ours.values()), our_docs()[:50])
    for block in theirs.values():
        run_datatrove([block], their_docs()[:50])

    cases = [(name, [name]) for name in FILTERS] + [("chain", FILTERS)]
    times: dict[str, dict[str, list[float]]] = {c: {"lmforge": [], "datatrove": []} for c, _ in cases}
    decisions: dict[str, dict[str, list[bool]]] = {c: {} for c, _ in cases}
    for _ in range(rounds):
        for case, names in cases:
            docs = our_docs()
            dt_, kept = timed(lambda names=names, docs=docs: run_lmforge([ours[n] for n in names], docs))
            times[case]["lmforge"].append(dt_)
            decisions[case]["lmforge"] = kept
            if all(n in theirs for n in names):
                docs = their_docs()
                dt_, kept = timed(
                    lambda names=names, docs=docs: run_datatrove([theirs[n] for n in names], docs)
                )
                times[case]["datatrove"].append(dt_)
                decisions[case]["datatrove"] = kept

    result: dict[str, Any] = {"docs": len(texts), "chars": sum(len(t) for _, t in texts), "rounds": rounds}
    rows = {}
    for case, _ in cases:
        row: dict[str, Any] = {}
        for side in ("lmforge", "datatrove"):
            if times[case][side]:
                row[f"{side}_docs_per_s"] = round(len(texts) / statistics.median(times[case][side]), 1)
                row[f"{side}_kept"] = sum(decisions[case][side])
        if "datatrove_docs_per_s" in row:
            row["speedup"] = round(row["lmforge_docs_per_s"] / row["datatrove_docs_per_s"], 2)
            a, b = decisions[case]["lmforge"], decisions[case]["datatrove"]
            row["same_decision"] = round(sum(x == y for x, y in zip(a, b, strict=True)) / len(a), 4)
        rows[case] = row
    result["filters"] = rows
    if skipped:
        result["datatrove_skipped"] = skipped
    return result


def _shuffled(text: str, rng: random.Random) -> str:
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def _reference_run(work: Path) -> Path:
    """A run of the default model trained here for 30 steps (only its size matters for timing)."""
    run = work / "reference"
    if not (run / "summary.json").exists():
        cmd = [sys.executable, "-m", "lmforge", "train", "--run-dir", str(run), "--train.steps=30"]
        cmd += [
            "--train.eval_interval=30",
            "--train.checkpoint_interval=30",
            f"--data.cache_dir={work / 'data'}",
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    return run


def _median_time(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_model_stages(n_docs: int, rounds: int, reference: Path | None) -> dict[str, Any]:
    """Documents per second of blocklist, classifier and perplexity, and of gopher_quality, same docs."""
    import torch

    from lmforge.corpus.config import StageSpec
    from lmforge.corpus.quality_model import train_quality_model

    texts = prose_documents(n_docs)
    docs = [Doc(i, t, "prose") for i, t in texts]
    rng = random.Random(0)
    half = [t for _, t in texts[::2]]
    work = Path(tempfile.mkdtemp(prefix="lmforge-bench-"))
    model, _ = train_quality_model(half, [_shuffled(t, rng) for t in half], seed=0)
    model.save(work / "quality.npz")
    run = reference or _reference_run(work)
    stages = {
        "gopher_quality": StageSpec(name="gopher_quality").build(),
        "blocklist": StageSpec(name="blocklist").build(),
        "classifier": StageSpec(name="classifier", params={"model": str(work / "quality.npz")}).build(),
    }
    torch.set_num_threads(1)
    rows: dict[str, Any] = {}
    for name, stage in stages.items():
        run_lmforge([stage], docs[:20])  # warm-up: regex compilation, vectorizers
        t = _median_time(lambda stage=stage: run_lmforge([stage], docs), rounds)
        rows[name] = {"docs_per_s_per_core": round(len(docs) / t, 1)}
    cores = default_workers()
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        ppl = StageSpec(name="perplexity", params={"run": str(run), "threads": threads}).build()
        group = max(1, ppl.signature_batch)
        ppl.signatures(docs[:group])  # warm-up: loads the model

        def score(ppl=ppl, group=group) -> None:
            for i in range(0, len(docs), group):
                ppl.signatures(docs[i : i + group])

        t = _median_time(score, rounds)
        rows[f"perplexity_{threads}_threads"] = {
            "docs_per_s": round(len(docs) / t, 1),
            "docs_per_s_per_core": round(len(docs) / t / threads, 1),
        }
    base = rows["gopher_quality"]["docs_per_s_per_core"]
    for row in rows.values():
        row["vs_gopher_quality"] = round(row["docs_per_s_per_core"] / base, 4)
    return {"docs": len(docs), "reference_run": str(run), "cores": cores, "stages": rows}


def print_model_stages(figures: dict[str, Any]) -> None:
    print(f"model-based stages, {figures['docs']} prose documents, one process ({figures['reference_run']})")
    print(f"{'stage':<22} {'docs/s per core':>16} {'vs gopher_quality':>18}")
    for name, row in figures["stages"].items():
        print(f"{name:<22} {row['docs_per_s_per_core']:>16} {row['vs_gopher_quality']:>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1000, help="prose documents from the built-in corpus")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds (median reported)")
    parser.add_argument("--no-minhash", action="store_true", help="time the quality filters only")
    parser.add_argument("--no-model-stages", action="store_true", help="skip part 3")
    parser.add_argument("--only-model-stages", action="store_true", help="run part 3 alone")
    parser.add_argument("--reference-run", type=Path, help="perplexity's run (default: a 30-step one)")
    args = parser.parse_args()

    if args.only_model_stages:
        figures = {"model_stages": bench_model_stages(args.docs, args.rounds, args.reference_run)}
        print_model_stages(figures["model_stages"])
        print(json.dumps(figures))
        return
    figures = bench_filters(args.docs, args.rounds)
    figures["datatrove_version"] = importlib.metadata.version("datatrove")
    print(f"{figures['docs']} prose documents, {figures['chars']:,} characters, one process, one core")
    print(
        f"{'filter':<18} {'lmforge docs/s':>15} {'datatrove docs/s':>17} {'speedup':>8} {'same decision':>14}"
    )
    for case, row in figures["filters"].items():
        print(
            f"{case:<18} {row.get('lmforge_docs_per_s', '-'):>15} {row.get('datatrove_docs_per_s', '-'):>17}"
            f" {row.get('speedup', '-'):>8} {row.get('same_decision', '-'):>14}"
        )
    for name, why in figures.get("datatrove_skipped", {}).items():
        print(f"datatrove {name} skipped: {why}")
    if not args.no_minhash:
        print()
        figures["minhash"] = bench_minhash(args.rounds, copies=1)
    if not args.no_model_stages:
        print()
        figures["model_stages"] = bench_model_stages(args.docs, args.rounds, args.reference_run)
        print_model_stages(figures["model_stages"])
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
