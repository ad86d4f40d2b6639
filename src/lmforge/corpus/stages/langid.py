"""Language identification with ``py3langid`` (the langid.py model, which ships inside the wheel).

The classifier scores all 97 languages of the model; the score kept is the normalised probability of
the best one (``norm_probs=True``). A document is kept when its language is one of ``languages`` and
its score is at least ``min_score``; a kept document's ``meta`` gets ``language`` and
``language_score``. Removal reasons: ``langid.language`` (another language: ``value`` is the detected
one, ``threshold`` the languages kept), ``langid.low_score`` (``value`` the score, ``threshold``
``min_score``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, Knob, StageParams

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def identifier() -> Any:
    """The py3langid classifier with normalised probabilities, loaded once per process (about 2 s)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    log.debug("loading the py3langid model")
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def classify(text: str) -> tuple[str, float]:
    """(ISO 639-1 code, normalised probability) of ``text``'s most likely language."""
    lang, score = identifier().classify(text)
    return str(lang), float(score)


class LangIdParams(StageParams):
    """Languages to keep and the smallest score. ``min_score = 0.65`` is FineWeb's language threshold
    (Penedo et al. 2024, there with the fastText classifier); ``languages = ["en"]`` follows the
    English-only corpora (C4, Gopher's MassiveText web part, FineWeb). ``max_chars`` bounds the work on
    long documents: the first characters decide (language ID is saturated long before 10,000)."""

    languages: list[str] = Field(["en"], description="ISO 639-1 codes of the languages to keep.")
    min_score: float = Field(
        0.65, ge=0.0, le=1.0, description="Smallest normalised probability of the detected language."
    )
    max_chars: int | None = Field(
        10_000, description="Classify only the first this many characters (None: the whole text)."
    )


class LangId(DocStage):
    """Keeps documents in the configured languages, with ``language`` / ``language_score`` in meta."""

    name = "langid"
    Params = LangIdParams
    filters = True
    strictness = (Knob("min_score", 0.0, 0.65),)  # strict end: FineWeb's threshold

    def __init__(self, params: LangIdParams | None = None):
        super().__init__(params)
        self._keep = frozenset(self.params.languages)

    def process(self, doc: Doc) -> Doc | Drop:
        p: LangIdParams = self.params
        text = doc.text if p.max_chars is None else doc.text[: p.max_chars]
        lang, score = classify(text)
        if lang not in self._keep:
            return self.drop("language", value=lang, threshold=tuple(p.languages))
        if score < p.min_score:
            return self.drop("low_score", value=score, threshold=p.min_score)
        return replace(doc, meta={**doc.meta, "language": lang, "language_score": round(score, 4)})
