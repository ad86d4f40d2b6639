"""``length``: drop documents outside a range of characters and of words.

Words are runs of non-whitespace (``str.split()``), as in the Gopher rules. Removal reasons:
``length.too_few_chars``, ``length.too_many_chars``, ``length.too_few_words``, ``length.too_many_words``,
each with the document's count as ``value`` and the bound as ``threshold``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, Knob, StageParams


class LengthParams(StageParams):
    """Bounds on document length; a bound left unset is not checked.

    Defaults: the word bounds are Gopher's document-length rule (Rae et al., 2021, "Scaling Language
    Models: Methods, Analysis & Insights from Training Gopher", appendix A.1.1: keep documents of 50 to
    100,000 words). There is no published character bound, so none is set by default.
    """

    min_chars: int | None = Field(None, ge=0, description="fewest characters kept (unset: no bound)")
    max_chars: int | None = Field(None, ge=1, description="most characters kept (unset: no bound)")
    min_words: int | None = Field(50, ge=0, description="fewest whitespace-separated words kept (Gopher: 50)")
    max_words: int | None = Field(100_000, ge=1, description="most words kept (Gopher: 100,000)")

    @model_validator(mode="after")
    def _ordered(self) -> LengthParams:
        for lo, hi in (("min_chars", "max_chars"), ("min_words", "max_words")):
            a, b = getattr(self, lo), getattr(self, hi)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{lo} ({a}) is above {hi} ({b})")
        return self


class LengthFilter(DocStage):
    name: ClassVar[str] = "length"
    Params: ClassVar[type[StageParams]] = LengthParams
    filters: ClassVar[bool] = True
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("min_words", 0, 50, integer=True),)  # strict: Gopher

    def process(self, doc: Doc) -> Doc | Drop:
        p = self.params
        assert isinstance(p, LengthParams)
        n = len(doc.text)
        if p.min_chars is not None and n < p.min_chars:
            return self.drop("too_few_chars", value=n, threshold=p.min_chars)
        if p.max_chars is not None and n > p.max_chars:
            return self.drop("too_many_chars", value=n, threshold=p.max_chars)
        if p.min_words is None and p.max_words is None:
            return doc
        words = len(doc.text.split())
        if p.min_words is not None and words < p.min_words:
            return self.drop("too_few_words", value=words, threshold=p.min_words)
        if p.max_words is not None and words > p.max_words:
            return self.drop("too_many_words", value=words, threshold=p.max_words)
        return doc
