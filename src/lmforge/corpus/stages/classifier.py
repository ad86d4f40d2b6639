"""``classifier``: keep documents a trained linear text classifier scores at least ``threshold``.

The model (:mod:`lmforge.corpus.quality_model`, trained by ``lmforge data train-classifier``) gives
P(positive) from hashed word and character n-grams. What "positive" means is the user's: a quality
classifier (reference text such as Wikipedia or books against random web pages, the idea of GPT-3's and
LLaMA's filters) or an educational-value scorer (pages labelled educational against the rest, FineWeb-Edu's
idea with labels the user supplies). The score goes in ``meta[meta_key]`` of every document (kept ones
carry it into ``OUT/kept``). Removal: ``classifier.low_score`` (``value`` the score, ``threshold`` the
threshold).

**Strictness.** ``threshold`` moves from 0.0 (lenient: nothing removed) to 0.9 (strict: only documents
the model is 90% sure of are kept). No published recipe fixes a threshold for a user's own model; 0.9
is the high end of what classifier-filtered corpora kept (FineWeb-Edu keeps the top of a 0-5 scale,
DCLM the top 10% of fastText scores), and the default 0.5 is the decision boundary of the balanced fit.

The model is read when the stage is built (a missing or damaged file stops ``lmforge data`` before any
work) and cached per process, so worker processes that rebuild the stage read it once.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.quality_model import QualityModel
from lmforge.corpus.stages.base import DocStage, Knob, StageParams
from lmforge.errors import ConfigError, UserError


class ClassifierParams(StageParams):
    """The model file, the smallest P(positive) kept and where the score is written."""

    model: str = Field(description="model file written by lmforge data train-classifier")
    threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="smallest P(positive) kept (0.5: the balanced decision boundary)"
    )
    meta_key: str = Field("quality_score", min_length=1, description="meta key the score is written to")


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime_ns: int, size: int) -> QualityModel:
    """The model at ``path``, read once per process per file version."""
    return QualityModel.load(path)


def load_model(path: str) -> QualityModel:
    """The model at ``path`` (cached by path, modification time and size)."""
    p = Path(path)
    if not p.is_file():
        return QualityModel.load(p)  # raises the missing-file error
    st = p.stat()
    return _load(str(p.resolve()), st.st_mtime_ns, st.st_size)


class Classifier(DocStage):
    """Scores each document with a quality model; removes those below ``threshold``."""

    name: ClassVar[str] = "classifier"
    Params: ClassVar[type[StageParams]] = ClassifierParams
    filters: ClassVar[bool] = True
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("threshold", 0.0, 0.9),)

    def __init__(self, params: ClassifierParams | None = None):
        if params is None:
            raise ConfigError(
                "classifier.model: required; give a file written by lmforge data train-classifier"
            )
        super().__init__(params)
        try:
            self._model = load_model(os.fspath(params.model))
        except UserError as exc:
            raise ConfigError(f"classifier.model: {exc}") from None

    def process(self, doc: Doc) -> Doc | Drop:
        p: ClassifierParams = self.params
        score = float(self._model.score([doc.text])[0])
        if score < p.threshold:
            return self.drop("low_score", value=round(score, 6), threshold=p.threshold)
        return replace(doc, meta={**doc.meta, p.meta_key: round(score, 6)})
