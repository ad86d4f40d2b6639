"""Training's reading of ``data.sources``: configured sources -> a stream of :class:`Doc`.

Formats: ``.txt`` (one document per file), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object
per line, text under a configurable key), ``.parquet`` (a text column), folders and globs of them, and
the built-in corpus ``builtin:pystdlib``. Files are visited in sorted order so ids and order are
deterministic. Finding the files and parsing them is :mod:`lmforge.corpus.readers` (the readers of
``lmforge data``); this module applies training's policy: only the formats above, errors name
``data.sources.*`` keys, and bad records are logged and skipped instead of stopping or being kept.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

from lmforge.config import SourceConfig
from lmforge.corpus import readers
from lmforge.corpus.document import Doc

log = logging.getLogger(__name__)

FORMATS = ("txt", "jsonl", "parquet")  # what training reads (HTML and PDF need the extract stage)


def source_files(source: SourceConfig, field: str = "data.sources.path") -> list[Path]:
    """The files a (non-built-in) source names, sorted; a folder is searched for training's formats."""
    return readers.expand_paths(source.path, field, FORMATS)


def _lenient(piece: readers.Piece, opts: readers.ReadOptions) -> Iterator[Doc]:
    """Good documents of a piece; bad records are logged and skipped (training reads trusted data)."""
    for out in readers.read_piece(piece, opts):
        if isinstance(out, tuple):
            doc, drop = out
            if drop.reason != "read.empty":
                log.warning("%s: skipped (%s)", doc.id, drop.reason)
            continue
        yield out


def source_domains(source: SourceConfig) -> tuple[str, ...]:
    """The domains a source's documents are filed under (known before reading any file)."""
    if source.domain is not None:
        return (source.domain,)
    if readers.builtin_corpus(source.path, "data.sources.path") == "pystdlib":
        from lmforge.corpus.pystdlib import DOMAINS

        return DOMAINS
    return ("default",)


def read_source(source: SourceConfig, include_tests: bool = False) -> Iterator[Doc]:
    """All documents of one configured source, in a deterministic order."""
    if readers.builtin_corpus(source.path, "data.sources.path") == "pystdlib":
        from lmforge.corpus.pystdlib import read_pystdlib

        for doc in read_pystdlib(include_tests=include_tests):
            yield doc if source.domain is None else Doc(doc.id, doc.text, source.domain)
        return
    opts = readers.ReadOptions(
        domain=source.domain or "default", text_field=source.text_field, strict_utf8=False
    )
    for path in source_files(source):
        fmt = source.format if source.format != "auto" else readers.detect_format(path, FORMATS)
        if fmt not in FORMATS:
            log.warning("%s: skipped (unsupported file type; expected one of %s)", path, ", ".join(FORMATS))
            continue
        if fmt == "parquet":
            readers.check_parquet_column(path, source.text_field, "data.sources.text_field")
        yield from _lenient(readers.whole_file(path, fmt), opts)


def is_validation(doc_id: str, fraction: float) -> bool:
    """Deterministic split: a document is held out when ``hash(id) / 2**64 < fraction`` (BLAKE2b-64)."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction
