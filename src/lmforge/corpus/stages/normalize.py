"""Unicode normalisation and whitespace clean-up.

In order: line endings become ``\\n`` (``\\r\\n``, ``\\r``, and the Unicode line/paragraph separators
U+0085, U+2028, U+2029); control characters other than newline and tab are removed, with the
byte-order mark and the zero-width space; the text is brought to the Unicode normal form (NFC by
default, which changes no meaning; NFKC also folds compatibility forms such as full-width letters and
ligatures); trailing whitespace is stripped from every line; runs of blank lines are collapsed to at
most ``max_blank_lines``; blank lines at the start and whitespace at the end are removed (indentation of
the first line is kept, so source code survives). A document left empty is dropped
(``normalize.empty``).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import replace
from typing import Literal

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, StageParams

_LINE_ENDINGS = re.compile("\r\n?|[\x85\u2028\u2029]")
# C0 and C1 controls except \t (09) and \n (0a); \r is gone by then. Plus BOM and zero-width space.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u200b]+")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)
_LEADING_BLANK_LINES = re.compile(r"\A(?:[^\S\n]*\n)+")


class NormalizeParams(StageParams):
    """Normal form and blank-line policy. NFC is the W3C / Unicode recommendation for text interchange
    (Unicode Standard Annex #15); NFKC is what several web corpora apply (it is lossy: "ﬁ" becomes
    "fi", "²" becomes "2")."""

    form: Literal["NFC", "NFKC", "NFD", "NFKD", "none"] = Field(
        "NFC", description="Unicode normal form (NFC keeps meaning; NFKC also folds compatibility forms)."
    )
    max_blank_lines: int = Field(1, ge=0, description="Longest run of blank lines kept.")
    remove_control: bool = Field(True, description="Remove control characters except newline and tab.")


class Normalize(DocStage):
    """Normalises Unicode and whitespace; drops documents left empty."""

    name = "normalize"
    Params = NormalizeParams

    def __init__(self, params: NormalizeParams | None = None):
        super().__init__(params)
        keep = self.params.max_blank_lines + 1
        self._blank_runs = re.compile("\n{" + str(keep + 1) + ",}")
        self._blank_repl = "\n" * keep

    def process(self, doc: Doc) -> Doc | Drop:
        p: NormalizeParams = self.params
        text = doc.text
        if "\r" in text or not text.isascii():
            text = _LINE_ENDINGS.sub("\n", text)
        if p.remove_control:
            text = _CONTROL.sub("", text)
        if p.form != "none" and not text.isascii() and not unicodedata.is_normalized(p.form, text):
            text = unicodedata.normalize(p.form, text)
        text = _TRAILING_SPACE.sub("", text)
        text = self._blank_runs.sub(self._blank_repl, text)
        text = _LEADING_BLANK_LINES.sub("", text).rstrip()
        if not text:
            return self.drop("empty")
        return doc if text == doc.text else replace(doc, text=text)
