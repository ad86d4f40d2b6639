"""``perplexity``: keep documents whose perplexity under a small lmforge model lies in a band or percentile range.

CCNet's idea (Wenzek et al. 2020, *CCNet: Extracting High Quality Monolingual Datasets from Web Crawl
Data*, section 3.3): a language model trained on text of known quality (there Wikipedia) scores every
document; low perplexity means "like the reference", and the corpus is cut into head / middle / tail
by the 33.3rd and 66.7th percentiles of the scores. Any lmforge run folder is the model here
(:class:`~lmforge.corpus.lm_scorer.LMScorer`: mean per-token loss over at most ``max_tokens`` tokens,
long documents in windows of the model's context), so train it on the text the kept documents should
resemble.

A corpus stage, since percentiles are the corpus's: ``signature`` is a document's perplexity (batched
across documents by ``signatures``, on every worker), ``plan`` computes the bounds over all scored
documents (``numpy.percentile``, linear interpolation) and stores each document's score in an SQLite
table under ``workdir``; ``apply`` keeps or removes a document and writes ``meta["perplexity"]``.

Removal reasons (``value`` = the document's perplexity, ``threshold`` = the bound it failed):
``perplexity.no_tokens`` (an empty document: no value), ``perplexity.below_band`` / ``above_band``
(``min_perplexity`` / ``max_perplexity``), ``perplexity.below_percentile`` / ``above_percentile`` (the
corpus's ``min_percentile`` / ``max_percentile`` point). Strictness moves ``max_percentile`` from 100
(keep all) to 33.3, CCNet's head.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from lmforge.corpus.document import Doc, Drop, key_text
from lmforge.corpus.executors import threads_per_worker
from lmforge.corpus.lm_scorer import LMScorer
from lmforge.corpus.stages.base import CorpusStage, Knob, StageParams
from lmforge.corpus.stages.docindex import scratch_db
from lmforge.errors import ConfigError

DB = "scores.sqlite"
BOUNDS = "bounds.json"
GROUP = 4  # documents per signatures() call: GROUP * batch_size (room to sort windows by length)


class PerplexityParams(StageParams):
    """The scoring run and the range kept. Defaults keep every document with tokens (percentiles 0..100,
    no band): the stage then only scores. CCNet's head is ``max_percentile = 33.3``, its middle
    ``min_percentile = 33.3, max_percentile = 66.7``."""

    run: str = Field(..., description="run folder of the scoring model (lmforge train's --run-dir)")
    step: int | None = Field(None, ge=0, description="checkpoint step of the run (None: its newest)")
    min_percentile: float = Field(
        0.0, ge=0, le=100, description="keep documents at or above this percentile of the corpus's scores"
    )
    max_percentile: float = Field(
        100.0, ge=0, le=100, description="keep documents at or below this percentile (CCNet head: 33.3)"
    )
    min_perplexity: float | None = Field(None, gt=0, description="absolute lower bound (None: no bound)")
    max_perplexity: float | None = Field(None, gt=0, description="absolute upper bound (None: no bound)")
    max_tokens: int = Field(2048, ge=1, description="tokens of each document scored (the first ones)")
    batch_size: int = Field(8, ge=1, description="windows per forward pass of the model")
    stride: int | None = Field(
        None, ge=1, description="window stride of documents longer than the context (None: half of it)"
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads per worker process (None: usable cores / worker processes)"
    )

    @model_validator(mode="after")
    def _ranges(self) -> PerplexityParams:
        if self.min_percentile > self.max_percentile:
            raise ValueError("min_percentile must not exceed max_percentile")
        if self.min_perplexity and self.max_perplexity and self.min_perplexity > self.max_perplexity:
            raise ValueError("min_perplexity must not exceed max_perplexity")
        return self


def percentile_bounds(scores: np.ndarray, low: float, high: float) -> tuple[float, float] | None:
    """``(numpy.percentile(s, low), numpy.percentile(s, high))`` over the finite scores ``s`` (linear
    interpolation: the value at rank ``p / 100 * (m - 1)`` of the ``m`` sorted scores); None if none."""
    finite = scores[np.isfinite(scores)]
    if finite.size == 0:
        return None
    lo, hi = np.percentile(finite, [low, high])
    return float(lo), float(hi)


def decide(
    score: float, bounds: tuple[float, float] | None, p: PerplexityParams
) -> tuple[str, float | None] | None:
    """None to keep a document of perplexity ``score``, else ``(rule, threshold)``: no tokens, then the
    absolute band, then the percentile bounds."""
    if not math.isfinite(score) or bounds is None:
        return "no_tokens", None
    if p.min_perplexity is not None and score < p.min_perplexity:
        return "below_band", p.min_perplexity
    if p.max_perplexity is not None and score > p.max_perplexity:
        return "above_band", p.max_perplexity
    if score < bounds[0]:
        return "below_percentile", bounds[0]
    if score > bounds[1]:
        return "above_percentile", bounds[1]
    return None


class Perplexity(CorpusStage):
    """Scores documents with a run's model; keeps a perplexity band and percentile range of the corpus."""

    name: ClassVar[str] = "perplexity"
    Params: ClassVar[type[StageParams]] = PerplexityParams
    filters: ClassVar[bool] = True
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("max_percentile", 100.0, 33.3),)

    def __init__(self, params: StageParams | None = None):
        super().__init__(params)
        p = self.params
        assert isinstance(p, PerplexityParams)
        try:
            self.scorer = LMScorer(p.run, p.step, p.max_tokens, p.batch_size, p.threads, p.stride)
        except ConfigError as exc:
            raise ConfigError(f"perplexity.{exc}") from None
        self.signature_batch = GROUP * p.batch_size
        self._db: dict[Path, tuple[sqlite3.Connection, tuple[float, float] | None]] = {}

    def _scorer(self) -> LMScorer:
        if self.scorer.threads is None:  # decided where the stage runs: the worker's share of the cores
            self.scorer.threads = threads_per_worker()
        return self.scorer

    def signature(self, doc: Doc) -> float:
        return float(self._scorer().score([doc.text])[0])

    def signatures(self, docs: list[Doc]) -> list[float]:
        return [float(s) for s in self._scorer().score([d.text for d in docs])]

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        p = self.params
        assert isinstance(p, PerplexityParams)
        db, tmp = scratch_db(workdir / DB)
        db.execute("CREATE TABLE score (k TEXT PRIMARY KEY, s REAL) WITHOUT ROWID")
        scores: list[float] = []
        for ref, sig in signatures:
            assert ref is not None
            scores.append(float(sig))
            db.execute(
                "INSERT INTO score VALUES (?, ?)", (key_text(ref.key), sig if math.isfinite(sig) else None)
            )
        db.commit()
        db.close()
        os.replace(tmp, workdir / DB)
        arr = np.asarray(scores, dtype=np.float64)
        bounds = percentile_bounds(arr, p.min_percentile, p.max_percentile)
        (workdir / BOUNDS).write_text(json.dumps({"bounds": bounds}))
        removed: dict[str, int] = {}
        for s in arr:
            rule = decide(float(s), bounds, p)
            if rule is not None:
                reason = f"{self.name}.{rule[0]}"
                removed[reason] = removed.get(reason, 0) + 1
        finite = arr[np.isfinite(arr)]
        quartiles = [round(float(q), 4) for q in np.percentile(finite, [25, 50, 75])] if finite.size else None
        return {
            "documents": int(arr.size),
            "scored": int(finite.size),
            "bounds": bounds,
            "quartiles": quartiles,
            "kept": int(arr.size) - sum(removed.values()),
            "removed": dict(sorted(removed.items())),
        }

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        p = self.params
        assert isinstance(p, PerplexityParams)
        if workdir not in self._db:
            uri = f"file:{(workdir / DB).resolve()}?mode=ro&immutable=1"
            bounds = json.loads((workdir / BOUNDS).read_text())["bounds"]
            self._db[workdir] = (
                sqlite3.connect(uri, uri=True, check_same_thread=False),
                tuple(bounds) if bounds is not None else None,
            )
        db, bounds = self._db[workdir]
        row = db.execute("SELECT s FROM score WHERE k = ?", (key_text(doc.key),)).fetchone()
        if row is None:
            raise KeyError(f"document {doc.id} ({key_text(doc.key)}) has no score in the plan")
        score = math.nan if row[0] is None else float(row[0])
        rule = decide(score, bounds, p)
        if rule is not None:
            return self.drop(rule[0], value=score if math.isfinite(score) else None, threshold=rule[1])
        return replace(doc, meta={**doc.meta, "perplexity": round(score, 4)})

    def __getstate__(self) -> dict[str, Any]:  # connections do not travel between processes
        return {**self.__dict__, "_db": {}}
