"""MinHash deduplication speed: lmforge's ``dedup_minhash`` against datatrove on the same documents.

Input: the ``pystdlib`` prose documents plus, for each, a copy with 5% of its words replaced (so the
buckets hold real duplicates). Both sides use the FineWeb setting (5-word shingles, 14 bands of 8).
One process, one core each (documents/s is per core):

* signatures: lmforge ``MinHashDedup.signature`` per document; datatrove ``MinhashDedupSignature``
  (text simplification, spaCy English word tokenizer, xxhash per shingle, numpy permutations, writing
  and sorting the per-bucket signature files);
* end to end (signatures, buckets, clusters): lmforge ``signature`` + ``plan`` (bucket records on
  disk, sort, verification, union-find, decisions table); datatrove ``MinhashDedupSignature`` +
  ``MinhashDedupBuckets`` (14 bucket tasks run one after another) + ``MinhashDedupCluster``.

Rounds alternate between the two sides and medians are reported, so drift in machine speed (a shared
machine) hits both alike. datatrove's English tokenizer is spaCy's blank ``en`` pipeline (no model
download); a second datatrove row with a whitespace tokenizer shows how much of its time is spaCy.

    python benchmarks/minhash.py [--rounds 3] [--copies 1]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from lmforge.corpus.document import Doc
from lmforge.corpus.pystdlib import read_pystdlib
from lmforge.corpus.stages.dedup_minhash import MinHashDedup


def edit_words(text: str, fraction: float, vocab: list[str], rng: random.Random) -> str:
    words = text.split()
    for k in rng.sample(range(len(words)), round(fraction * len(words))):
        words[k] = rng.choice(vocab)
    return " ".join(words)


def corpus(copies: int) -> list[Doc]:
    rng = random.Random(0)
    originals = [d for d in read_pystdlib() if d.domain == "prose"]
    vocab = sorted({w for d in originals[:50] for w in d.text.split()})
    docs = [Doc(d.id, d.text, "prose", (0, 0, i)) for i, d in enumerate(originals)]
    for c in range(copies):
        docs += [
            Doc(f"{d.id}#copy{c}", edit_words(d.text, 0.05, vocab, rng), "prose", (1 + c, 0, i))
            for i, d in enumerate(originals)
        ]
    return docs


def run_lmforge(docs: list[Doc]) -> tuple[float, float, dict]:
    stage = MinHashDedup()
    t0 = time.perf_counter()
    refs = [(Doc(d.id, "", d.domain, d.key), stage.signature(d)) for d in docs]
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        figures = stage.plan(iter(refs), Path(work))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0, figures


def run_datatrove(docs: list[Doc], whitespace: bool) -> tuple[float, float, int]:
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupSignature,
    )
    from loguru import logger

    logger.remove()  # datatrove logs every step to stderr (its modules add the handler on import)
    config = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes, xxhash 64-bit
    with tempfile.TemporaryDirectory() as work:
        w = Path(work)
        language = "en"
        if whitespace:
            from datatrove.utils.word_tokenizers import WordTokenizer

            class Whitespace(WordTokenizer):
                def word_tokenize(self, text: str) -> list[str]:
                    return text.split()

                def sent_tokenize(self, text: str) -> list[str]:
                    return [text]

                def span_tokenize(self, text: str) -> list[tuple[int, int]]:
                    return [(0, len(text))]

            language = Whitespace()
        sig = MinhashDedupSignature(str(w / "sigs"), config=config, language=language)
        inputs = [Document(text=d.text, id=d.id) for d in docs]
        t0 = time.perf_counter()
        sig.run(iter(inputs), rank=0, world_size=1)
        t1 = time.perf_counter()
        buckets = MinhashDedupBuckets(str(w / "sigs"), str(w / "buckets"), config=config)
        for b in range(config.num_buckets):
            buckets.run(None, rank=b, world_size=config.num_buckets)
        MinhashDedupCluster(str(w / "buckets"), str(w / "remove"), config=config).run(None, 0, 1)
        t2 = time.perf_counter()
        remove = w / "remove" / "000000.remove"
        removed = remove.stat().st_size // 4 if remove.exists() else 0
    return t1 - t0, t2 - t0, removed


def bench_minhash(rounds: int, copies: int) -> dict:
    """Time both sides over ``rounds`` alternating rounds; print a table and return the figures."""
    try:
        import datatrove  # noqa: F401

        have_datatrove = True
    except ImportError as e:
        print(f"datatrove not available ({e}); install the bench extra: pip install -e '.[bench]'")
        have_datatrove = False

    docs = corpus(copies)
    n = len(docs)
    mb = sum(len(d.text.encode()) for d in docs) / 1e6
    print(f"{n} documents, {mb:.1f} MB (pystdlib prose + {copies} copy/copies with 5% of words replaced)")
    times: dict[str, list[tuple[float, float]]] = {"lmforge": [], "datatrove": [], "datatrove_ws": []}
    removed: dict[str, int] = {}
    for r in range(rounds):
        sig_s, total_s, fig = run_lmforge(docs)
        times["lmforge"].append((sig_s, total_s))
        removed["lmforge"] = fig["duplicates"]
        if have_datatrove:
            for key, ws in (("datatrove", False), ("datatrove_ws", True)):
                try:
                    sig_s, total_s, rem = run_datatrove(docs, ws)
                except Exception as e:  # report what cannot run here, keep the rest
                    print(f"{key}: could not run: {type(e).__name__}: {e}")
                    have_datatrove = False
                    break
                times[key].append((sig_s, total_s))
                removed[key] = rem
        print(f"round {r + 1}/{rounds} done")

    def rate(key: str, which: int) -> float | None:
        if not times[key]:
            return None
        return round(n / statistics.median(t[which] for t in times[key]), 1)

    result = {"documents": n, "megabytes": round(mb, 2), "rounds": rounds}
    print(f"{'':28s}{'signatures docs/s':>20s}{'end to end docs/s':>20s}{'removed':>10s}")
    for key, label in (
        ("lmforge", "lmforge dedup_minhash"),
        ("datatrove", "datatrove (spaCy words)"),
        ("datatrove_ws", "datatrove (whitespace words)"),
    ):
        s, e = rate(key, 0), rate(key, 1)
        result[f"{key}_signature_docs_per_s"] = s
        result[f"{key}_end_to_end_docs_per_s"] = e
        result[f"{key}_removed"] = removed.get(key)
        if s is not None:
            print(f"{label:28s}{s:>20,.1f}{e:>20,.1f}{removed.get(key, 0):>10d}")
    for key in ("datatrove", "datatrove_ws"):
        if result[f"{key}_signature_docs_per_s"]:
            sig_ratio = result["lmforge_signature_docs_per_s"] / result[f"{key}_signature_docs_per_s"]
            e2e_ratio = result["lmforge_end_to_end_docs_per_s"] / result[f"{key}_end_to_end_docs_per_s"]
            result[f"speedup_vs_{key}_signature"] = round(sig_ratio, 2)
            result[f"speedup_vs_{key}_end_to_end"] = round(e2e_ratio, 2)
            print(f"lmforge / {key}: signatures {sig_ratio:.2f}x, end to end {e2e_ratio:.2f}x")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copies", type=int, default=1, help="edited copies per original document")
    args = ap.parse_args()
    print(json.dumps(bench_minhash(args.rounds, args.copies)))


if __name__ == "__main__":
    main()
