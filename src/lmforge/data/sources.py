"""Readers: turn configured sources into a stream of :class:`Document`.

Formats: ``.txt`` (one document per file), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object
per line, text under a configurable key), ``.parquet`` (a text column), folders and globs of them, and
the built-in corpus ``builtin:pystdlib``. Files are visited in sorted order so ids and order are
deterministic.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from lmforge.config import SourceConfig
from lmforge.errors import DataError

log = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


@dataclass(frozen=True)
class Document:
    id: str
    text: str
    domain: str


def detect_format(path: Path) -> str:
    """``txt`` | ``jsonl`` | ``parquet`` from the file name, or ``""`` if unsupported."""
    name = path.name.lower()
    if name.endswith(".txt"):
        return "txt"
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return ""


def expand_paths(pattern: str, field: str = "data.sources.path") -> list[Path]:
    """A file, a folder (searched recursively for supported files) or a glob -> sorted file list."""
    path = Path(pattern).expanduser()
    if any(ch in pattern for ch in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and detect_format(p)]
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"{field}: {pattern} does not exist; give an existing file, folder or glob")
    files = sorted(p for p in files if p.is_file())
    if not files:
        raise DataError(
            f"{field}: {pattern} matches no {'/'.join(SUFFIXES)} files; check the path or pattern"
        )
    return files


def _open_text(path: Path) -> IO[str]:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if name.endswith(".zst"):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
    return path.open("r", encoding="utf-8", errors="replace")


def read_txt(path: Path, domain: str) -> Iterator[Document]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.strip():
        yield Document(str(path), text, domain)


def read_jsonl(path: Path, domain: str, text_field: str) -> Iterator[Document]:
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[text_field]
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("%s:%d: skipped (not a JSON object with a %r string)", path, lineno, text_field)
                continue
            if not isinstance(text, str) or not text.strip():
                continue
            doc_id = record.get("id") if isinstance(record, dict) else None
            yield Document(str(doc_id) if doc_id is not None else f"{path}:{lineno}", text, domain)


def read_parquet(path: Path, domain: str, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    table = pq.ParquetFile(path)
    names = table.schema_arrow.names
    if text_field not in names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set data.sources.text_field"
        )
    columns = [text_field] + (["id"] if "id" in names else [])
    row = 0
    for batch in table.iter_batches(columns=columns, batch_size=4096):
        texts = batch.column(0).to_pylist()
        ids = batch.column(1).to_pylist() if len(columns) > 1 else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            if isinstance(text, str) and text.strip():
                yield Document(str(doc_id) if doc_id is not None else f"{path}:{row}", text, domain)
            row += 1


def source_domains(source: SourceConfig) -> tuple[str, ...]:
    """The domains a source's documents are filed under (known before reading any file)."""
    if source.domain is not None:
        return (source.domain,)
    if source.path == "builtin:pystdlib":
        from lmforge.data.pystdlib import DOMAINS

        return DOMAINS
    return ("default",)


def read_source(source: SourceConfig, include_tests: bool = False) -> Iterator[Document]:
    """All documents of one configured source, in a deterministic order."""
    if source.path.startswith("builtin:"):
        name = source.path.removeprefix("builtin:")
        if name != "pystdlib":
            raise DataError(
                f"data.sources.path: unknown built-in corpus {name!r}; the built-in corpus is pystdlib"
            )
        from lmforge.data.pystdlib import read_pystdlib

        for doc in read_pystdlib(include_tests=include_tests):
            yield doc if source.domain is None else Document(doc.id, doc.text, source.domain)
        return
    domain = source.domain or "default"
    for path in expand_paths(source.path):
        fmt = source.format if source.format != "auto" else detect_format(path)
        if fmt == "txt":
            yield from read_txt(path, domain)
        elif fmt == "jsonl":
            yield from read_jsonl(path, domain, source.text_field)
        elif fmt == "parquet":
            yield from read_parquet(path, domain, source.text_field)
        else:
            log.warning("%s: skipped (unsupported file type; expected one of %s)", path, ", ".join(SUFFIXES))


def is_validation(doc_id: str, fraction: float) -> bool:
    """Deterministic split: a document is held out when ``hash(id) / 2**64 < fraction`` (BLAKE2b-64)."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction
