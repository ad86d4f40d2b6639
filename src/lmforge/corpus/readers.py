"""Readers of every input format: which files a source names, and their records, reporting bad input.

:func:`expand_paths` turns a configured path (file, folder, glob) into a sorted file list and
:func:`detect_format` names a file's reader by its suffix; :func:`builtin_corpus` recognises
``builtin:pystdlib`` (:mod:`lmforge.corpus.pystdlib`). Both ``lmforge data`` and training's
``data.sources`` (:mod:`lmforge.data.sources`) use these; each applies its own policy to bad records.

A :class:`Piece` is a contiguous part of one input file: a whole file, a byte range of an uncompressed
JSONL file (cut at line boundaries), or a range of row groups of a parquet file. :func:`read_piece`
yields, in file order, a :class:`~lmforge.corpus.document.Doc` per good record and a ``(doc, Drop)``
pair per bad one, with the reason ``read.<rule>`` and the file and line in ``doc.meta``:

* ``read.malformed_json``: a JSONL line that does not parse;
* ``read.missing_text``: a record that is not an object or whose text field is absent or not a string;
* ``read.empty``: a document whose text is empty or only whitespace;
* ``read.invalid_utf8``: bytes that do not decode as UTF-8 (a JSONL line; a whole ``.txt`` or ``.html``
  file also not as its declared charset (HTML) nor as the encoding :func:`detect_encoding` finds);
* ``read.truncated`` / ``read.corrupt``: a compressed stream that ends early or does not decompress
  (the records before the damage are kept);
* ``read.binary``: a file with NUL bytes where text is expected; ``read.not_pdf``: a ``.pdf`` without
  the PDF header; ``read.unknown_format``: a file whose format cannot be told from its name.

A whole file decoded from another encoding than UTF-8 carries it in ``doc.meta["encoding"]`` (Python's
codec name, e.g. ``cp1252``); ``lmforge data`` counts it as ``read.decoded_<encoding>`` in
``report.json``'s ``meta``.

Everything is read in blocks, so memory does not grow with the file. Compressed streams are decoded
with ``zlib`` / ``zstandard`` decompressor objects rather than file wrappers because the zstandard
stream reader ends quietly on a truncated frame; the decompressor's ``eof`` flag tells truncation apart.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import re
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmforge.corpus.document import Doc, Drop
from lmforge.errors import DataError

log = logging.getLogger(__name__)

BLOCK = 1 << 20
SNIFF = 8192
SUFFIXES: dict[str, tuple[str, ...]] = {
    "txt": (".txt",),
    "jsonl": (".jsonl", ".jsonl.gz", ".jsonl.zst"),
    "parquet": (".parquet",),
    "html": (".html", ".htm"),
    "pdf": (".pdf",),
}
FORMATS = tuple(SUFFIXES)
BUILTIN = ("pystdlib",)


@dataclass(frozen=True)
class ReadOptions:
    """How records of one source become documents."""

    domain: str = "default"
    text_field: str = "text"
    id_field: str = "id"
    format_field: str | None = None  # JSONL: a record key whose value "html" marks raw HTML content
    content_format: str = "text"  # JSONL / txt: "html" marks every document as raw HTML
    strict_utf8: bool = True  # False: replace undecodable bytes (the training reader's behaviour)


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one input file; ``start``/``end`` are bytes (JSONL) or row groups (parquet)."""

    source: int
    file: int
    path: str
    fmt: str
    start: int = 0
    end: int = -1
    first_line: int = 1
    size: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def detect_format(path: Path, formats: tuple[str, ...] = FORMATS) -> str:
    """The reader for ``path`` by its name among ``formats`` (txt, jsonl, ...), or ``""`` if none."""
    name = path.name.lower()
    return next((fmt for fmt in formats if name.endswith(SUFFIXES[fmt])), "")


def expand_paths(pattern: str, field: str, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """A file, a folder (searched recursively for files of ``formats``) or a glob -> sorted file list.

    A glob keeps every file it matches (a file of no known format is reported when read); problems are a
    DataError naming ``field``.
    """
    path = Path(pattern).expanduser()
    if any(ch in pattern for ch in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and detect_format(p, formats)]
    elif path.is_file():
        files = [path]
    else:
        raise DataError(f"{field}: {pattern} does not exist; give an existing file, folder or glob")
    files = sorted(p for p in files if p.is_file())
    if not files:
        suffixes = "/".join(s for fmt in formats for s in SUFFIXES[fmt])
        raise DataError(f"{field}: {pattern} matches no {suffixes} files; check the path or pattern")
    return files


def builtin_corpus(path: str, field: str) -> str | None:
    """The name of the built-in corpus ``path`` names (``builtin:NAME``), None for a file path.

    An unknown name is a DataError naming ``field``.
    """
    if not path.startswith("builtin:"):
        return None
    name = path.removeprefix("builtin:")
    if name not in BUILTIN:
        raise DataError(
            f"{field}: unknown built-in corpus {name!r}; the built-in corpus is {', '.join(BUILTIN)}"
        )
    return name


def check_parquet_column(path: Path, text_field: str, key: str) -> None:
    """DataError naming ``key`` unless the parquet file at ``path`` has the column ``text_field``."""
    names = parquet_columns(path)
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set {key}")


def compression(path: str | Path) -> str:
    name = str(path).lower()
    return "gzip" if name.endswith(".gz") else "zstd" if name.endswith(".zst") else ""


# ---------------------------------------------------------------------------------------------------------
# planning: pieces of a file


def plan_pieces(source: int, file: int, path: Path, fmt: str, chunk_bytes: int) -> list[Piece]:
    """Cut one file into pieces of about ``chunk_bytes`` (only plain JSONL and parquet can be cut).

    JSONL cuts fall just after a newline; each piece records the number of its first line, counted
    while scanning, so ids (``path:line``) do not depend on the cut.
    """
    size = path.stat().st_size
    whole = Piece(source, file, str(path), fmt, size=size)
    if fmt == "jsonl":
        if _has_nul(path):
            return [Piece(source, file, str(path), "binary", size=size)]
        if compression(path) or size <= chunk_bytes:
            return [whole]
        return _jsonl_pieces(source, file, path, size, chunk_bytes)
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
        except Exception as exc:  # pyarrow raises several types for damaged files
            log.warning("%s: not a readable parquet file (%s)", path, exc)
            return [Piece(source, file, str(path), "corrupt", size=size)]
        pieces, start, row, acc, first = [], 0, 0, 0, 0
        for g in range(meta.num_row_groups):
            acc += meta.row_group(g).total_byte_size
            row += meta.row_group(g).num_rows
            if acc >= chunk_bytes or g == meta.num_row_groups - 1:
                pieces.append(Piece(source, file, str(path), fmt, start, g + 1, first, acc))
                start, first, acc = g + 1, row, 0
        return pieces or [whole]
    return [whole]


def _has_nul(path: Path) -> bool:
    if compression(path):
        return False  # checked on the decompressed stream instead
    with path.open("rb") as fh:
        return b"\0" in fh.read(SNIFF)


def _jsonl_pieces(source: int, file: int, path: Path, size: int, chunk_bytes: int) -> list[Piece]:
    pieces: list[Piece] = []
    start, line = 0, 1
    with path.open("rb") as fh:
        while start < size:
            target = start + chunk_bytes
            if target >= size:
                end = size
            else:
                fh.seek(target)
                fh.readline()  # move to the start of the next line
                end = min(fh.tell(), size)
            pieces.append(Piece(source, file, str(path), "jsonl", start, end, line, end - start))
            fh.seek(start)
            remaining = end - start
            while remaining:
                block = fh.read(min(BLOCK, remaining))
                line += block.count(b"\n")
                remaining -= len(block)
            start = end
    return pieces


# ---------------------------------------------------------------------------------------------------------
# reading


class _Damaged(Exception):
    def __init__(self, rule: str):
        self.rule = rule


def _blocks(path: Path, start: int = 0, end: int = -1) -> Iterator[bytes]:
    """Decompressed bytes of ``path`` (or of ``[start, end)`` of a plain file); raises ``_Damaged``."""
    kind = compression(path)
    with path.open("rb") as fh:
        if not kind:
            fh.seek(start)
            remaining = (end if end >= 0 else path.stat().st_size) - start
            while remaining > 0:
                block = fh.read(min(BLOCK, remaining))
                if not block:
                    return
                remaining -= len(block)
                yield block
            return
        dec, fed = _decompressor(kind), False
        while data := fh.read(BLOCK):
            while data:
                try:
                    out = dec.decompress(data)
                except (zlib.error, _zstd_error()) as exc:
                    log.warning("%s: corrupt compressed data (%s)", path, exc)
                    raise _Damaged("corrupt") from None
                fed = True
                if out:
                    yield out
                if dec.eof:  # a frame / gzip member ended: another may follow
                    data = dec.unused_data
                    dec, fed = _decompressor(kind), False
                else:
                    data = b""
        if fed and not dec.eof:
            raise _Damaged("truncated")


def json_records(path: Path) -> Iterator[Any]:
    """The JSON values of a JSONL file lmforge wrote itself; damage is a DataError naming the file."""
    rest = b""
    try:
        for block in _blocks(path):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                yield json.loads(raw)
    except (_Damaged, ValueError) as exc:
        raise DataError(f"{path}: damaged ({exc}); delete the output folder and run again") from None
    if rest.strip():
        yield json.loads(rest)


def _decompressor(kind: str) -> Any:
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


def _bad(
    piece: Piece, opts: ReadOptions, line: int, rule: str, doc_id: str | None = None
) -> tuple[Doc, Drop]:
    meta = {"file": piece.path, "line": line}
    doc_id = doc_id or (f"{piece.path}:{line}" if line else piece.path)
    return Doc(doc_id, "", opts.domain, (piece.source, piece.file, line), meta), Drop(f"read.{rule}")


def whole_file(path: Path, fmt: str) -> Piece:
    """The piece that is all of ``path`` read as ``fmt`` (parquet rows are numbered from 0, lines from 1)."""
    return Piece(0, 0, str(path), fmt, first_line=0 if fmt == "parquet" else 1)


def read_piece(piece: Piece, opts: ReadOptions) -> Iterator[Doc | tuple[Doc, Drop]]:
    """Documents of one piece in file order; bad records as ``(doc, Drop("read.<rule>"))``."""
    path = Path(piece.path)
    try:
        if piece.fmt == "jsonl":
            yield from _read_jsonl(piece, path, opts)
        elif piece.fmt in ("txt", "html", "pdf"):
            yield _read_whole(piece, path, opts)
        elif piece.fmt == "parquet":
            yield from _read_parquet(piece, path, opts)
        elif piece.fmt in ("binary", "corrupt"):
            yield _bad(piece, opts, 0, piece.fmt)
        else:
            yield _bad(piece, opts, 0, "unknown_format")
    except OSError as exc:  # a file that vanished or cannot be read: reported, the run goes on
        log.warning("%s: unreadable (%s)", path, exc)
        yield _bad(piece, opts, 0, "unreadable")


def _decode(raw: bytes, strict: bool) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace") if not strict else None


def _read_jsonl(piece: Piece, path: Path, opts: ReadOptions) -> Iterator[Doc | tuple[Doc, Drop]]:
    lineno = piece.first_line - 1
    rest = b""
    sniffed = bool(piece.start)  # the planner sniffed plain files; compressed ones are sniffed here
    try:
        for block in _blocks(path, piece.start, piece.end):
            if not sniffed:
                sniffed = True
                if b"\0" in block[:SNIFF]:
                    yield _bad(piece, opts, 0, "binary")
                    return
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for raw in lines:
                lineno += 1
                out = _jsonl_record(piece, opts, raw, lineno)
                if out is not None:
                    yield out
    except _Damaged as exc:
        yield _bad(piece, opts, lineno + 1, exc.rule)
        return
    if rest:
        out = _jsonl_record(piece, opts, rest, lineno + 1)
        if out is not None:
            yield out


def _jsonl_record(piece: Piece, opts: ReadOptions, raw: bytes, lineno: int) -> Doc | tuple[Doc, Drop] | None:
    if not raw.strip():
        return None  # a blank line is no record
    line = _decode(raw, opts.strict_utf8)
    if line is None:
        return _bad(piece, opts, lineno, "invalid_utf8")
    try:
        record = json.loads(line)
    except ValueError:
        return _bad(piece, opts, lineno, "malformed_json")
    text = record.get(opts.text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        return _bad(piece, opts, lineno, "missing_text")
    doc_id = record.get(opts.id_field)
    doc_id = str(doc_id) if doc_id is not None else f"{piece.path}:{lineno}"
    if not text.strip():
        return _bad(piece, opts, lineno, "empty", doc_id)
    meta: dict[str, Any] = {}
    if opts.content_format == "html" or (
        opts.format_field and str(record.get(opts.format_field, "")).lower() == "html"
    ):
        meta["format"] = "html"
    return Doc(doc_id, text, opts.domain, (piece.source, piece.file, lineno), meta)


_CHARSET = re.compile(rb"""charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


def _read_whole(piece: Piece, path: Path, opts: ReadOptions) -> Doc | tuple[Doc, Drop]:
    raw = path.read_bytes()
    if not raw.strip():
        return _bad(piece, opts, 0, "empty")
    key = (piece.source, piece.file, 0)
    if piece.fmt == "pdf":
        if b"%PDF-" not in raw[:1024]:
            return _bad(piece, opts, 0, "not_pdf")
        return Doc(str(path), "", opts.domain, key, {"format": "pdf", "raw": raw})
    if b"\0" in raw[:SNIFF]:
        return _bad(piece, opts, 0, "binary")
    meta: dict[str, Any] = {"format": "html"} if piece.fmt == "html" or opts.content_format == "html" else {}
    text = _decode(raw, True)
    if text is None:
        decoded = (_decode_declared(raw) if piece.fmt == "html" else None) or detect_encoding(raw)
        if decoded is not None:
            text, meta["encoding"] = decoded
        elif not opts.strict_utf8:
            text = raw.decode("utf-8", errors="replace")
        else:
            return _bad(piece, opts, 0, "invalid_utf8")
    if not text.strip():
        return _bad(piece, opts, 0, "empty")
    return Doc(str(path), text, opts.domain, key, meta)


def _decode_declared(raw: bytes) -> tuple[str, str] | None:
    """HTML in a legacy encoding: ``(text, codec)`` with the charset its ``<meta>`` declares, if Python
    knows it."""
    match = _CHARSET.search(raw[:4096])
    if not match:
        return None
    try:
        codec = codecs.lookup(match.group(1).decode("ascii")).name
        return raw.decode(codec), codec
    except (LookupError, UnicodeDecodeError):
        return None


# the web's default for legacy pages that declare no encoding (WHATWG Encoding Standard, most locales)
WESTERN = "cp1252"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")


def detect_encoding(raw: bytes) -> tuple[str, str] | None:
    """``(text, codec)`` of bytes that are not UTF-8, else None (left to the caller: invalid UTF-8).

    Bytes whose non-ASCII characters are mostly valid UTF-8 sequences are damaged UTF-8, not another
    encoding: None.
    Otherwise ``charset_normalizer`` proposes encodings with a "mess" ratio; among the least messy
    (within 0.05 of the best) windows-1252 is taken when it is one of them, as browsers do for an
    undeclared legacy page (the detector alone tells Latin-1 from Latin-4 poorly on short text: "garçon"
    came back "garįon"); else the best, when it also recognises a language in the text. Text with
    control characters is refused (binary data that happens to decode)."""
    from charset_normalizer import from_bytes

    lenient = raw.decode("utf-8", errors="replace")
    if sum(ord(c) > 127 for c in lenient) > 2 * lenient.count("\ufffd"):  # mostly valid UTF-8
        return None
    matches = sorted(from_bytes(raw), key=lambda m: m.chaos)
    if not matches:
        return None
    near = [m for m in matches if m.chaos <= matches[0].chaos + 0.05]
    if any(WESTERN in m.could_be_from_charset for m in near):
        codec = WESTERN
    elif matches[0].coherence > 0:
        codec = codecs.lookup(matches[0].encoding).name
    else:
        return None
    try:
        text = raw.decode(codec)
    except UnicodeDecodeError:
        return None
    return None if _CONTROL.search(text) else (text, codec)


def _read_parquet(piece: Piece, path: Path, opts: ReadOptions) -> Iterator[Doc | tuple[Doc, Drop]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    columns = [opts.text_field] + ([opts.id_field] if opts.id_field in names else [])
    end = pf.metadata.num_row_groups if piece.end < 0 else piece.end
    row = piece.first_line
    for batch in pf.iter_batches(columns=columns, batch_size=4096, row_groups=range(piece.start, end)):
        texts = batch.column(0).to_pylist()
        ids = batch.column(1).to_pylist() if len(columns) > 1 else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            name = str(doc_id) if doc_id is not None else f"{piece.path}:{row}"
            if not isinstance(text, str):
                yield _bad(piece, opts, row, "missing_text", name)
            elif not text.strip():
                yield _bad(piece, opts, row, "empty", name)
            else:
                yield Doc(name, text, opts.domain, (piece.source, piece.file, row), {})
            row += 1


def parquet_columns(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).schema_arrow.names
