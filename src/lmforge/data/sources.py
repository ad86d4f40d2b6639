"""Training's reading of ``data.sources``: configured sources -> a stream of :class:`Doc`.

Formats: ``.txt`` (one document per file), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one JSON object
per line, text under a configurable key), ``.parquet`` (a text column), folders and globs of them, and
the built-in corpus ``builtin:pystdlib``. Files are visited in sorted order so ids and order are
deterministic. The parsing itself lives in :mod:`lmforge.corpus.readers` (shared with ``lmforge data``);
here bad records are logged and skipped.
"""

from __future__ import annotations

import glob
import hashlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from lmforge.config import SourceConfig
from lmforge.corpus import readers
from lmforge.corpus.document import Doc
from lmforge.errors import DataError

log = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def detect_format(path: Path) -> str:
    """``txt`` | ``jsonl`` | ``parquet`` from the file name, or ``""`` if training cannot read it."""
    fmt = readers.detect_format(path)
    return fmt if fmt in ("txt", "jsonl", "parquet") else ""


def expand_paths(
    pattern: str,
    field: str = "data.sources.path",
    detect: Callable[[Path], str] = detect_format,
    suffixes: tuple[str, ...] = SUFFIXES,
) -> list[Path]:
    """A file, a folder (searched recursively for files ``detect`` knows) or a glob -> sorted file list."""
    path = Path(pattern).expanduser()
    if any(ch in pattern for ch in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and detect(p)]
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"{field}: {pattern} does not exist; give an existing file, folder or glob")
    files = sorted(p for p in files if p.is_file())
    if not files:
        raise DataError(
            f"{field}: {pattern} matches no {'/'.join(suffixes)} files; check the path or pattern"
        )
    return files


def _lenient(piece: readers.Piece, opts: readers.ReadOptions) -> Iterator[Doc]:
    """Good documents of a piece; bad records are logged and skipped (training reads trusted data)."""
    for out in readers.read_piece(piece, opts):
        if isinstance(out, tuple):
            doc, drop = out
            if drop.reason != "read.empty":
                log.warning("%s: skipped (%s)", doc.id, drop.reason)
            continue
        yield out


def read_txt(path: Path, domain: str) -> Iterator[Doc]:
    opts = readers.ReadOptions(domain=domain, strict_utf8=False)
    yield from _lenient(readers.Piece(0, 0, str(path), "txt"), opts)


def read_jsonl(path: Path, domain: str, text_field: str) -> Iterator[Doc]:
    opts = readers.ReadOptions(domain=domain, text_field=text_field, strict_utf8=False)
    yield from _lenient(readers.Piece(0, 0, str(path), "jsonl"), opts)


def read_parquet(path: Path, domain: str, text_field: str) -> Iterator[Doc]:
    check_parquet_column(path, text_field, "data.sources.text_field")
    opts = readers.ReadOptions(domain=domain, text_field=text_field)
    yield from _lenient(readers.Piece(0, 0, str(path), "parquet", first_line=0), opts)


def check_parquet_column(path: Path, text_field: str, key: str) -> None:
    names = readers.parquet_columns(path)
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set {key}")


def source_domains(source: SourceConfig) -> tuple[str, ...]:
    """The domains a source's documents are filed under (known before reading any file)."""
    if source.domain is not None:
        return (source.domain,)
    if source.path == "builtin:pystdlib":
        from lmforge.corpus.pystdlib import DOMAINS

        return DOMAINS
    return ("default",)


def read_source(source: SourceConfig, include_tests: bool = False) -> Iterator[Doc]:
    """All documents of one configured source, in a deterministic order."""
    if source.path.startswith("builtin:"):
        name = source.path.removeprefix("builtin:")
        if name != "pystdlib":
            raise DataError(
                f"data.sources.path: unknown built-in corpus {name!r}; the built-in corpus is pystdlib"
            )
        from lmforge.corpus.pystdlib import read_pystdlib

        for doc in read_pystdlib(include_tests=include_tests):
            yield doc if source.domain is None else Doc(doc.id, doc.text, source.domain)
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
