"""``lmforge data sweep``: the cleaning trade-off measured, from lenient to strict.

The recipe runs through the real pipeline (:func:`lmforge.corpus.pipeline.run_pipeline`, resumable,
parallel) once per strictness level (:mod:`lmforge.corpus.strictness`) into ``OUT/level-LLL``; then the
kept documents of every level are measured with the same fixed references:

* **size**: documents, UTF-8 bytes, words and tokens kept (tokens by one reference tokenizer for all
  levels: ``--tokenizer``, else the reference run's, else a byte-level BPE trained on level 0's kept
  text and saved as ``OUT/tokenizer.json``);
* **quality**: the mean score of the kept documents under one reference scorer: a quality classifier
  (probability of the good class, higher is better) or a language model run (per-document perplexity,
  lower is better); the recipe's first ``classifier`` / ``perplexity`` stage is the default reference;
* **diversity**: distinct word n-grams per token, the same on a fixed-size sample (the first ``K`` words
  of the kept documents in a seeded order, ``K`` the smallest level's word count, so that a smaller
  corpus does not look more diverse only because it is smaller) and the entropy of the word
  distribution (:func:`vocab_entropy`).

Writes ``OUT/sweep.json`` and ``OUT/sweep.png`` (the three curves against the level).

The tokens are counted by training's tokenizer (:mod:`lmforge.tokenizer`, the layer below both
``corpus/`` and ``data/``), so the sweep's token counts are those ``lmforge data`` shards with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.corpus.config import PipelineConfig
from lmforge.corpus.strictness import check_level, config_at, knob_table
from lmforge.errors import ConfigError
from lmforge.progress import Progress
from lmforge.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger(__name__)

DEFAULT_LEVELS = (0.0, 20.0, 40.0, 60.0, 80.0, 100.0)
_WORD = re.compile(r"\w+")


# ---------------------------------------------------------------------------------------------------------
# the measures (pure functions)


def words_of(text: str) -> list[str]:
    """Lower-cased word tokens: runs of Unicode letters, digits and underscores (``\\w+``)."""
    return _WORD.findall(text.lower())


def distinct_ngrams(words: Sequence[str], n: int) -> int:
    """Number of distinct word n-grams in ``words`` (one sequence; n-grams do not cross its ends)."""
    return len({tuple(words[i : i + n]) for i in range(len(words) - n + 1)})


def distinct_ngrams_in(docs: Iterable[Sequence[str]], n: int, limit: int | None = None) -> tuple[int, int]:
    """``(distinct n-grams, words read)`` over documents, n-grams within a document, reading at most
    ``limit`` words (the last document read is cut there)."""
    seen: set[int] = set()
    total = 0
    for words in docs:
        if limit is not None and total + len(words) > limit:
            words = words[: limit - total]
        total += len(words)
        seen.update(hash(tuple(words[i : i + n])) for i in range(len(words) - n + 1))
        if limit is not None and total >= limit:
            break
    return len(seen), total


def vocab_entropy(counts: Counter[str]) -> float:
    """Shannon entropy in bits of the word distribution: ``H = -sum_w p(w) log2 p(w)``, ``p(w) = c(w) / N``."""
    total = sum(counts.values())
    if total == 0:
        return 0.0
    return -sum(c / total * math.log2(c / total) for c in counts.values())


# ---------------------------------------------------------------------------------------------------------
# the references


@dataclass
class Reference:
    """A fixed scorer of documents: ``score(texts)`` gives one number per text."""

    kind: str  # "classifier" or "perplexity"
    path: str
    score: Callable[[list[str]], np.ndarray]

    @property
    def higher_is_better(self) -> bool:
        return self.kind == "classifier"

    @property
    def label(self) -> str:
        return (
            "classifier P(good), higher is better"
            if self.kind == "classifier"
            else "perplexity, lower is better"
        )


def pick_reference(cfg: PipelineConfig, classifier: str | None, run: str | None) -> tuple[str, str]:
    """``(kind, path)`` of the reference scorer: the flags, else the recipe's first model stage."""
    if classifier and run:
        raise ConfigError("--reference-classifier and --reference-run: give one reference, not both")
    if classifier:
        return "classifier", classifier
    if run:
        return "perplexity", run
    for spec in cfg.stages:
        if spec.name == "classifier" and spec.params.get("model"):
            return "classifier", str(spec.params["model"])
        if spec.name == "perplexity" and spec.params.get("run"):
            return "perplexity", str(spec.params["run"])
    raise ConfigError(
        "--reference-classifier: the recipe has no classifier or perplexity stage to score quality with; "
        "give a model (lmforge data train-classifier) or --reference-run RUN"
    )


def load_reference(kind: str, path: str, max_tokens: int = 512) -> Reference:
    """The scorer behind ``(kind, path)``; a missing file or run is a one-line ConfigError. A run scores
    the first ``max_tokens`` tokens of each document."""
    if kind == "classifier":
        from lmforge.corpus.quality_model import QualityModel

        if not Path(path).exists():
            raise ConfigError(
                f"--reference-classifier: {path} does not exist; train one with lmforge data train-classifier"
            )
        model = QualityModel.load(path)
        return Reference(kind, path, model.score)
    from lmforge.corpus.lm_scorer import LMScorer

    if not Path(path).is_dir():
        raise ConfigError(f"--reference-run: {path} is not a run folder; give the folder of a trained run")
    scorer = LMScorer(path, max_tokens=max_tokens)
    return Reference(kind, path, scorer.score)


# ---------------------------------------------------------------------------------------------------------
# the sweep


def level_dir(out: Path, level: float) -> Path:
    """``OUT/level-LLL`` (``level-012.5`` for a fractional level)."""
    return out / (f"level-{int(level):03d}" if level == int(level) else f"level-{level:05.1f}")


def parse_levels(text: str) -> list[float]:
    """``"0,25,50"`` -> sorted distinct levels, each checked to lie in 0..100."""
    try:
        levels = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--levels: {text!r} is not a comma-separated list of numbers (0..100)") from None
    if not levels:
        raise ConfigError("--levels: give at least one level (0..100), e.g. 0,50,100")
    return [check_level(x) for x in levels]


def _kept_texts(out: Path) -> list[tuple[str, str]]:
    from lmforge.corpus.pipeline import iter_kept

    return [(d.id, d.text) for d in iter_kept(out)]


def _reference_tokenizer(out: Path, tokenizer: str | None, ref: Reference, texts: list[str], vocab: int):
    if tokenizer:
        return Tokenizer(tokenizer), tokenizer
    if ref.kind == "perplexity" and (Path(ref.path) / "tokenizer.json").is_file():
        path = Path(ref.path) / "tokenizer.json"
        return Tokenizer(path), str(path)
    path = out / "tokenizer.json"
    if path.is_file():
        return Tokenizer(path), str(path)
    shown = Progress(f"sweep: training a {vocab}-token reference tokenizer on level 0's kept text")
    with shown, shown.ticking():
        return train_tokenizer(texts, vocab, path), str(path)


SCORE_CHUNK = 256  # documents scored per call of the reference: the unit its progress is shown in


def _scores(ref: Reference, texts: list[str], cache: dict[str, float], level: float) -> list[float]:
    """Reference scores of ``texts``, each distinct text scored once across levels; shown as a phase
    (documents scored, rate, time left): a run as reference takes minutes on a CPU."""
    keys = [hashlib.sha1(t.encode("utf-8", "surrogatepass")).hexdigest() for t in texts]
    todo = sorted({k for k in keys if k not in cache})
    if todo:
        text_of = dict(zip(keys, texts, strict=True))
        what = f"sweep: level {level:g}: scoring with the reference {ref.kind}"
        with Progress(what, len(todo), "documents") as shown, shown.ticking():
            for at in range(0, len(todo), SCORE_CHUNK):
                chunk = todo[at : at + SCORE_CHUNK]
                for k, s in zip(chunk, ref.score([text_of[k] for k in chunk]).tolist(), strict=True):
                    cache[k] = float(s)
                shown.update(len(chunk))
    return [cache[k] for k in keys]


def _row(
    lv: float,
    kept: list[tuple[str, str]],
    words: list[list[str]],
    report: dict[str, Any],
    tok: Any,
    ref: Reference,
    cache: dict[str, float],
    ngram: int,
    k_words: int,
    seed: int,
) -> dict[str, Any]:
    """The figures of one level: size, reference quality and diversity of its kept documents."""
    texts = [t for _, t in kept]
    tokens = sum(len(ids) for ids in tok.encode_batch(texts)) if texts else 0
    scores = _scores(ref, texts, cache, lv) if texts else []
    finite = [s for s in scores if math.isfinite(s)]
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    distinct_all, n_words = distinct_ngrams_in(words, ngram)
    distinct_k, read_k = distinct_ngrams_in((words[i] for i in order), ngram, k_words)
    return {
        "level": lv,
        "documents": len(texts),
        "documents_input": report["documents"]["input"],
        "bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in texts),
        "words": n_words,
        "tokens": tokens,
        "quality_mean": float(np.mean(finite)) if finite else None,
        "quality_median": float(np.median(finite)) if finite else None,
        "distinct_ngrams_per_token": distinct_all / tokens if tokens else None,
        "distinct_ngrams_at_k": distinct_k / read_k if read_k else None,
        "vocab_entropy_bits": vocab_entropy(Counter(w for ws in words for w in ws)),
        "removed": report["removed"],
    }


def run_sweep(
    cfg: PipelineConfig,
    out: str | Path,
    levels: Sequence[float] = DEFAULT_LEVELS,
    reference: tuple[str, str] | None = None,
    tokenizer: str | None = None,
    ngram: int = 2,
    workers: int | None = None,
    executor: str | None = None,
    seed: int = 0,
    reference_tokens: int = 512,
) -> dict[str, Any]:
    """Run ``cfg`` at every level into ``OUT/level-*``, measure the kept documents, write
    ``OUT/sweep.json`` and ``OUT/sweep.png``; returns the JSON's content."""
    from lmforge.corpus.pipeline import run_pipeline

    out = Path(out)
    levels = [check_level(x) for x in levels]
    if ngram < 1:
        raise ConfigError(f"--ngram: {ngram} is below 1")
    if tokenizer and not Path(tokenizer).is_file():
        raise ConfigError(f"--tokenizer: {tokenizer} does not exist; give a tokenizer.json or leave it out")
    kind, path = reference if reference is not None else pick_reference(cfg, None, None)
    if reference_tokens < 1:
        raise ConfigError(f"--reference-tokens: {reference_tokens} is below 1")
    ref = load_reference(
        kind, path, reference_tokens
    )  # before any work: a bad reference stops the sweep at once
    configs = {lv: config_at(cfg, lv) for lv in levels}
    out.mkdir(parents=True, exist_ok=True)
    reports: dict[float, dict[str, Any]] = {}
    for n, lv in enumerate(levels):
        log.info("sweep: level %g (%d of %d) -> %s", lv, n + 1, len(levels), level_dir(out, lv))
        reports[lv] = run_pipeline(configs[lv], level_dir(out, lv), executor=executor, workers=workers)

    kept = {lv: _kept_texts(level_dir(out, lv)) for lv in levels}
    base = kept[min(levels)]
    tok, tok_path = _reference_tokenizer(out, tokenizer, ref, [t for _, t in base], cfg.tokenize.vocab_size)
    words = {lv: [words_of(t) for _, t in kept[lv]] for lv in levels}
    k_words = max(1, min(sum(len(w) for w in words[lv]) for lv in levels))
    cache: dict[str, float] = {}
    rows = []
    with Progress("sweep: measuring the kept documents", len(levels), "levels") as shown, shown.ticking():
        for lv in levels:
            rows.append(_row(lv, kept[lv], words[lv], reports[lv], tok, ref, cache, ngram, k_words, seed))
            shown.update()
    result = {
        "levels": list(levels),
        "reference": {"kind": ref.kind, "path": ref.path, "higher_is_better": ref.higher_is_better},
        "reference_tokens": reference_tokens if ref.kind == "perplexity" else None,
        "tokenizer": tok_path,
        "ngram": ngram,
        "k_words": k_words,
        "seed": seed,
        "knobs": knob_table(cfg, list(levels)),
        "rows": rows,
        "optimum": marked_optimum(rows, ref.higher_is_better),
    }
    tmp = out / "sweep.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / "sweep.json")
    sweep_chart(result, ref.label, out / "sweep.png")
    return result


# ---------------------------------------------------------------------------------------------------------
# the optimum


def scaled(values: list[float | None]) -> list[float | None]:
    """``(v - min) / (max - min)`` over the non-missing values (1 for each when they are all equal)."""
    present = [v for v in values if v is not None]
    if not present:
        return [None] * len(values)
    lo, hi = min(present), max(present)
    return [None if v is None else (1.0 if hi == lo else (v - lo) / (hi - lo)) for v in values]


def optimum(
    rows: list[dict[str, Any]], higher_is_better: bool, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> dict[str, Any]:
    """The level a sweep marks as the best trade-off, by this rule (``lmforge data sweep`` with weights 1, 1, 1;
    the dashboard's cleaning page with the user's). Each curve is scaled to [0, 1] across the levels,
    ``c_hat_i = (c_i - min c) / (max c - min c)`` (1 when all are equal):

    * size: ``tokens`` kept;
    * quality: ``quality_mean`` under the sweep's reference, flipped (``1 - c_hat``) when lower is better
      (perplexity);
    * diversity: ``distinct_ngrams_at_k`` (distinct n-grams per word at the equal size ``K``).

    ``score_i = (w_s size_i + w_q quality_i + w_d diversity_i) / (w_s + w_q + w_d)``; the optimum is the level
    of the highest score (a tie goes to the more lenient level, which keeps more). A level with a missing
    figure (no document kept) has no score. Returns the scaled curves, the scores and the optimum's
    ``index`` (None when no level has every figure or every weight is 0)."""
    size = scaled([r.get("tokens") for r in rows])
    quality = scaled([r.get("quality_mean") for r in rows])
    if not higher_is_better:
        quality = [None if q is None else 1.0 - q for q in quality]
    diversity = scaled([r.get("distinct_ngrams_at_k") for r in rows])
    ws, wq, wd = weights
    total = ws + wq + wd
    scores: list[float | None] = []
    for s, q, d in zip(size, quality, diversity, strict=True):
        ok = total > 0 and None not in (s, q, d)
        scores.append((ws * s + wq * q + wd * d) / total if ok else None)
    best = None
    for i, sc in enumerate(scores):
        if sc is not None and (best is None or sc > scores[best]):
            best = i
    return {"size": size, "quality": quality, "diversity": diversity, "score": scores, "index": best}


def marked_optimum(rows: list[dict[str, Any]], higher_is_better: bool) -> dict[str, Any] | None:
    """What ``sweep.json`` records as its optimum: :func:`optimum` with weights 1, 1, 1 (None when no level
    has every figure)."""
    best = optimum(rows, higher_is_better)
    i = best["index"]
    if i is None:
        return None
    return {"level": rows[i]["level"], "score": best["score"][i], "weights": [1.0, 1.0, 1.0]}


def sweep_chart(result: dict[str, Any], quality_label: str, path: Path) -> Any:
    """Three panels against the strictness level: size kept (% of level 0's input), mean quality,
    diversity. Returns the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result["rows"]
    x = [r["level"] for r in rows]
    fig = Figure(figsize=(13, 3.8))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    docs0 = max(r["documents_input"] for r in rows) or 1
    tokens0 = max(r["tokens"] for r in rows) or 1
    ax1.plot(x, [100 * r["documents"] / docs0 for r in rows], "o-", label="documents (% of input)")
    ax1.plot(x, [100 * r["tokens"] / tokens0 for r in rows], "s-", label="tokens (% of most kept)")
    ax1.set_title("size kept")
    ax1.set_ylim(0, 105)
    ax1.legend(fontsize=8)
    q = [r["quality_mean"] for r in rows]
    ax2.plot(x, [v if v is not None else float("nan") for v in q], "o-", color="tab:green")
    ax2.set_title(f"mean quality: {quality_label}", fontsize=10)
    n = result["ngram"]
    ax3.plot(
        x,
        [r["distinct_ngrams_at_k"] or float("nan") for r in rows],
        "o-",
        label=f"distinct {n}-grams / word, first {result['k_words']:,} words",
    )
    ax3.plot(
        x,
        [r["distinct_ngrams_per_token"] or float("nan") for r in rows],
        "s--",
        label=f"distinct {n}-grams / token, all kept",
    )
    ax3.set_title("diversity")
    ax3.legend(fontsize=7, loc="lower left")
    ax4 = ax3.twinx()
    ax4.plot(x, [r["vocab_entropy_bits"] for r in rows], "^:", color="tab:red")
    ax4.set_ylabel("word entropy (bits)", color="tab:red")
    best = result.get("optimum")
    for ax in (ax1, ax2, ax3):
        ax.set_xlabel("strictness level")
        ax.grid(alpha=0.3)
        if best is not None:
            ax.axvline(best["level"], color="goldenrod", ls="--", lw=1.2)
    title = "strictness 0: no filtering, 100: the strictest documented thresholds"
    if best is not None:
        title += f"; dashed: the optimum, level {best['level']:g} (size, quality, diversity weighted equally)"
    fig.suptitle(title, fontsize=9)
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return fig


def sweep_table(result: dict[str, Any]) -> str:
    """The sweep as a plain-text table, one line per level."""
    n = result["ngram"]
    head = f"{'level':>6} {'docs':>8} {'tokens':>11} {'quality':>9} {f'd{n}/tok':>8} {f'd{n}@K':>7} {'H(bits)':>8}"
    lines = [head]
    best = (result.get("optimum") or {}).get("level")
    for r in result["rows"]:
        q = "-" if r["quality_mean"] is None else f"{r['quality_mean']:.4g}"
        d = "-" if r["distinct_ngrams_per_token"] is None else f"{r['distinct_ngrams_per_token']:.4f}"
        dk = "-" if r["distinct_ngrams_at_k"] is None else f"{r['distinct_ngrams_at_k']:.4f}"
        lines.append(
            f"{r['level']:>6g} {r['documents']:>8,} {r['tokens']:>11,} {q:>9} {d:>8} {dk:>7} {r['vocab_entropy_bits']:>8.3f}"
            + ("  <- optimum" if r["level"] == best else "")
        )
    if best is not None:
        lines.append(
            f"optimum: level {best:g} (size, quality and diversity each scaled to 0..1 across the levels, "
            "weighted equally; corpus/sweep.py::optimum)"
        )
    return "\n".join(lines)
