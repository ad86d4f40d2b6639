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

trafilatura's fallback extractors (readability, jusText) use ``lxml.html.clean``, which lxml 5.2+ no
longer bundles: the ``lxml_html_clean`` package provides it (a declared dependency).
"""

from __future__ import annotations

import io
import logging
from dataclasses import replace

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
            text = trafilatura.extract(
                html,
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
