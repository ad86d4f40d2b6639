"""Text extraction: HTML pages with ``trafilatura`` (main content, without navigation, footers and
other boilerplate) and PDF files with ``pypdf``.

Readers mark raw inputs in ``doc.meta["format"]``: ``"html"`` with the HTML as ``text``, ``"pdf"`` with
the file's bytes in ``meta["raw"]``. The extracted text replaces ``text`` and both meta keys are
removed. A document that cannot be extracted is dropped with the reason, never raised:

* ``extract.html_empty``: the HTML is blank; ``extract.no_main_content``: trafilatura found no main
  content; ``extract.html_error``: the parser failed;
* ``extract.pdf_missing``: no bytes in ``meta["raw"]``; ``extract.pdf_error``: pypdf could not read the
  file (corrupt, truncated, not a PDF); ``extract.pdf_encrypted``: it needs a password;
  ``extract.pdf_empty``: no text layer (a scanned PDF needs OCR, which is not done here);
* ``extract.unknown_format``: a ``format`` other than ``html`` / ``pdf``.

Documents without ``meta["format"]`` pass through unchanged.

**Wrapped lines** (``join_wrapped_lines``, on by default). HTML source is often wrapped at a fixed width
(editors, documentation generators), and a line break in the source inside a paragraph is, on the
page, a space. trafilatura keeps such breaks wherever a paragraph has inline markup (``<code>``,
``<em>``, ``<a>``), so a paragraph came out as several lines, each a sentence fragment that line-level
filters (C4's terminal punctuation rule) then removed one by one. Before extraction, a run of
whitespace holding a line break becomes one space when it lies inside running text: within a text
node, or where the text meets an inline element. Whitespace between block elements (paragraphs,
headings, list items, table cells) is left alone, so each block still starts a new line; ``<br>``
stays a line break; text inside ``<pre>``, ``<code>``, ``<textarea>`` (and ``<listing>``, ``<xmp>``,
``<plaintext>``) keeps its line breaks.

trafilatura's fallback extractors (readability, jusText) use ``lxml.html.clean``, which lxml 5.2+ no
longer bundles: the ``lxml_html_clean`` package provides it (a declared dependency).
"""

from __future__ import annotations

import io
import logging
import re
from dataclasses import replace
from typing import Any

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, StageParams

log = logging.getLogger(__name__)


class ExtractParams(StageParams):
    """trafilatura and pypdf options. ``favor_precision = true`` and ``include_comments = false`` are
    FineWeb's extraction settings (Penedo et al. 2024); ``include_tables = true`` is trafilatura's
    default. trafilatura's ``deduplicate`` option is never used: it keeps a cache across documents,
    which would make a document's text depend on the ones processed before it."""

    favor_precision: bool = Field(True, description="trafilatura: prefer less but cleaner text (FineWeb).")
    include_comments: bool = Field(False, description="trafilatura: keep the page's comment section.")
    include_tables: bool = Field(True, description="trafilatura: keep the text of tables.")
    fast: bool = Field(False, description="trafilatura: skip the fallback extractors (faster, less recall).")
    join_wrapped_lines: bool = Field(
        True,
        description="HTML: a line break of the page's source inside running text becomes a space, as a "
        "browser shows it (paragraphs, headings, list items, `<br>` and `<pre>`/`<code>` keep their breaks).",
    )
    pdf_page_separator: str = Field("\n\n", description="Put between the text of consecutive PDF pages.")


class Extract(DocStage):
    """HTML / PDF to plain text."""

    name = "extract"
    Params = ExtractParams

    def process(self, doc: Doc) -> Doc | Drop:
        fmt = doc.meta.get("format")
        if fmt is None:
            return doc
        if fmt == "html":
            out = self.html_to_text(doc.text)
        elif fmt == "pdf":
            out = self.pdf_to_text(doc.meta.get("raw"))
        else:
            return self.drop("unknown_format")
        if isinstance(out, Drop):
            return out
        meta = {k: v for k, v in doc.meta.items() if k not in ("format", "raw")}
        return replace(doc, text=out, meta=meta)

    def html_to_text(self, html: str) -> str | Drop:
        import trafilatura

        p: ExtractParams = self.params
        if not html or not html.strip():
            return self.drop("html_empty")
        try:
            page: Any = html
            if p.join_wrapped_lines:
                tree = trafilatura.load_html(html)
                if tree is not None:  # else trafilatura sees the string and reports as before
                    join_wrapped_lines(tree)
                    page = tree
            text = trafilatura.extract(
                page,
                favor_precision=p.favor_precision,
                include_comments=p.include_comments,
                include_tables=p.include_tables,
                fast=p.fast,
                deduplicate=False,
                output_format="txt",
            )
        except Exception as err:  # any parser failure is the document's problem, not the run's
            log.debug("extract: trafilatura failed: %s", err)
            return self.drop("html_error")
        if not text or not text.strip():
            return self.drop("no_main_content")
        return text

    def pdf_to_text(self, raw: bytes | None) -> str | Drop:
        from pypdf import PdfReader

        if not raw:
            return self.drop("pdf_missing")
        try:
            reader = PdfReader(io.BytesIO(raw))
            if reader.is_encrypted:
                try:
                    if not reader.decrypt(""):
                        return self.drop("pdf_encrypted")
                except Exception:
                    return self.drop("pdf_encrypted")
            pages = [page.extract_text() or "" for page in reader.pages]
        except Exception as err:  # corrupt, truncated or not a PDF at all
            log.debug("extract: pypdf failed: %s", err)
            return self.drop("pdf_error")
        text = self.params.pdf_page_separator.join(t.strip() for t in pages if t.strip())
        if not text:
            return self.drop("pdf_empty")
        return text


# Phrasing content (HTML Living Standard, section 3.2.5.2.5) that flows inside a line of text; <br> is
# left out: the break it makes is real.
_INLINE = frozenset((
    "a", "abbr", "b", "bdi", "bdo", "big", "cite", "code", "data", "del", "dfn", "em", "font", "i", "img",
    "ins", "kbd", "label", "mark", "q", "s", "samp", "small", "span", "strike", "strong", "sub", "sup",
    "time", "tt", "u", "var", "wbr",
))  # fmt: skip
# Elements whose text keeps its line breaks (rendered preformatted, or code).
_PREFORMATTED = frozenset(("pre", "code", "textarea", "listing", "plaintext", "xmp", "script", "style"))
# A run of HTML whitespace (space, tab, form feed, CR, LF) holding at least one line break.
_BREAK_RUN = re.compile(r"[ \t\f]*[\r\n][ \t\r\n\f]*")


def _inline(node: Any) -> bool:
    """Whether ``node`` flows within a line (an inline element; comments and the like vanish)."""
    return not isinstance(node.tag, str) or node.tag.lower() in _INLINE


def _join(text: str, left_inline: bool, right_inline: bool) -> str:
    """``text`` with each line-break run inside running text made one space; a run at an edge of
    ``text`` is changed only when the neighbour on that side is inline."""
    if "\n" not in text and "\r" not in text:
        return text

    def space(m: re.Match[str]) -> str:
        if (m.start() == 0 and not left_inline) or (m.end() == len(text) and not right_inline):
            return m.group()
        return " "

    return _BREAK_RUN.sub(space, text)


def join_wrapped_lines(root: Any) -> None:
    """Turn the source's line breaks inside running text of the lxml tree ``root`` into spaces, in place
    (see the module docstring). Iterative: a deeply nested page does not hit the recursion limit."""
    stack = [(root, False)]
    while stack:
        el, inside_pre = stack.pop()
        keep = inside_pre or (isinstance(el.tag, str) and el.tag.lower() in _PREFORMATTED)
        children = list(el)
        if not keep and isinstance(el.tag, str) and el.text:
            first = _inline(children[0]) if children else _inline(el)
            el.text = _join(el.text, _inline(el), first)
        for i, child in enumerate(children):
            if not keep and child.tail:
                after = _inline(children[i + 1]) if i + 1 < len(children) else _inline(el)
                child.tail = _join(child.tail, _inline(child), after)
            stack.append((child, keep))
