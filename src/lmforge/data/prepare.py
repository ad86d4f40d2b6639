"""Sources -> tokenizer -> token shards, cached and rebuilt only when an input changes.

The cache folder ``<data.cache_dir>/<key>/`` is named by a hash of the data settings that shape it
(sources, vocabulary size, validation fraction, tokenizer path). Inside, ``meta.json`` records the
fingerprint of the input bytes and the tokenizer's hash. A later run with the same settings reuses the
folder when both still match; when an input file or the tokenizer changed, everything is rebuilt in a
fresh folder that replaces the old one in one rename, so old and new tokens are never mixed.

Each document is stored as ``<|endoftext|>`` followed by its tokens, so packed sequences carry the
separator at every document start. Shards are per (domain, split): ``code.train-00000.bin``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmforge.config import DataConfig
from lmforge.corpus import readers
from lmforge.corpus.document import Doc
from lmforge.corpus.pystdlib import stdlib_files, topics_file
from lmforge.data.shards import Shard, ShardWriter, open_shards, read_meta, token_dtype, write_meta
from lmforge.data.sources import is_validation, read_source, source_files
from lmforge.errors import DataError
from lmforge.progress import Progress
from lmforge.tokenizer import Tokenizer, batched, train_tokenizer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class PreparedData:
    """A ready data folder: tokenizer plus train and validation shards."""

    root: Path
    tokenizer: Tokenizer
    meta: dict
    train: list[Shard] = field(default_factory=list)
    val: list[Shard] = field(default_factory=list)
    train_names: list[str] = field(default_factory=list)  # shard names of ``train``, same order

    def train_by_domain(self) -> dict[str, list[Shard]]:
        """Training shards per domain (shard ``<domain>.train-NNNNN``), domains in sorted order."""
        out: dict[str, list[Shard]] = {}
        for name, shard in zip(self.train_names, self.train, strict=True):
            out.setdefault(name.rsplit(".train-", 1)[0], []).append(shard)
        return dict(sorted(out.items()))

    @property
    def unigram_counts(self) -> np.ndarray:
        with (self.root / "unigram_counts.npy").open("rb") as fh:
            return np.load(fh, allow_pickle=False)


def settings_key(cfg: DataConfig) -> str:
    """Hash of the settings that determine the prepared data (not seq_len: packing happens later)."""
    shape = {
        "sources": [s.model_dump() for s in cfg.sources],
        "vocab_size": cfg.vocab_size,
        "val_fraction": cfg.val_fraction,
        "tokenizer": str(Path(cfg.tokenizer).resolve()) if cfg.tokenizer else None,
        "include_tests": cfg.include_tests,
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def input_files(cfg: DataConfig) -> list[Path]:
    if cfg.prepared is not None:
        root = prepared_root(cfg.prepared)
        return [root / "meta.json", root / "tokenizer.json"]
    files: list[Path] = []
    for i, source in enumerate(cfg.sources):
        if readers.builtin_corpus(source.path, f"data.sources[{i}].path") == "pystdlib":
            topics = topics_file()
            files.extend([*stdlib_files(cfg.include_tests), *([topics] if topics else [])])
        else:
            files.extend(source_files(source, f"data.sources[{i}].path"))
    return files


def input_fingerprint(cfg: DataConfig) -> str:
    """SHA-256 over (path, content) of every input file: any edit, addition or removal changes it."""
    h = hashlib.sha256(sys.version.encode())
    for path in input_files(cfg):
        h.update(str(path).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def iter_documents(cfg: DataConfig) -> Iterator[Doc]:
    for source in cfg.sources:
        yield from read_source(source, cfg.include_tests)


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Return prepared data for ``cfg``, building or rebuilding it when needed."""
    if cfg.prepared is not None:
        root = prepared_root(cfg.prepared)
        meta = read_meta(root)
        assert meta is not None
        data = _open(root, Tokenizer(root / "tokenizer.json"), meta)
        if not data.train or not data.val:
            raise DataError(f"data.prepared: {root} lacks train or validation shards; run lmforge data again")
        log.info("data: using prepared shards in %s", root)
        return data
    root = Path(cfg.cache_dir) / settings_key(cfg)
    fingerprint = input_fingerprint(cfg)
    user_tok = Tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    meta = read_meta(root)
    if meta is not None and meta.get("input_fingerprint") == fingerprint:
        tok = Tokenizer(root / "tokenizer.json")
        if tok.sha256 == meta["tokenizer_sha256"] and (user_tok is None or user_tok.sha256 == tok.sha256):
            log.info("data: reusing %s", root)
            return _open(root, tok, meta)
        log.info("data: tokenizer changed; rebuilding %s", root)
    elif meta is not None:
        log.info("data: input changed; rebuilding %s", root)
    build = root.with_name(root.name + ".building")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    _build(cfg, build, fingerprint, user_tok)
    old = root.with_name(root.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if root.exists():
        root.rename(old)
    build.rename(root)
    shutil.rmtree(old, ignore_errors=True)
    meta = read_meta(root)
    assert meta is not None
    return _open(root, Tokenizer(root / "tokenizer.json"), meta)


def prepared_root(path: str | Path) -> Path:
    """The shard folder of ``data.prepared``: ``OUT/tokens`` of a ``lmforge data`` output, or the folder."""
    root = Path(path)
    if (root / "tokens" / "meta.json").is_file():
        root = root / "tokens"
    if read_meta(root) is None or not (root / "tokenizer.json").is_file():
        raise DataError(
            f"data.prepared: {path} holds no token shards (meta.json, tokenizer.json); "
            "give the --out folder of a finished 'lmforge data' run"
        )
    return root


def _open(root: Path, tok: Tokenizer, meta: dict) -> PreparedData:
    names = sorted(meta["shards"])
    train_names = [n for n in names if ".train-" in n]
    return PreparedData(
        root=root,
        tokenizer=tok,
        meta=meta,
        train=open_shards(root, train_names),
        val=open_shards(root, [n for n in names if ".val-" in n]),
        train_names=train_names,
    )


def _build(cfg: DataConfig, build: Path, fingerprint: str, user_tok: Tokenizer | None) -> None:
    paths = ", ".join(s.path for s in cfg.sources)
    write_token_shards(
        build,
        lambda: iter_documents(cfg),
        cfg.vocab_size,
        cfg.val_fraction,
        user_tok,
        fingerprint,
        f"data.sources: no documents with text in {paths}; check the paths and text_field",
    )


def write_token_shards(
    build: Path,
    documents: Callable[[], Iterable[Doc]],
    vocab_size: int,
    val_fraction: float,
    user_tok: Tokenizer | None,
    fingerprint: str,
    no_docs_error: str,
) -> dict:
    """Tokenizer + token shards per (domain, split) + ``meta.json`` in ``build``; returns the meta.

    ``documents`` is called twice (tokenizer training, then tokenizing) and must give the same stream.
    """
    tok_path = build / "tokenizer.json"
    n_docs: float | None = None  # documents in the stream, when the tokenizer's training counted them
    if user_tok is not None:
        shutil.copyfile(user_tok.path, tok_path)
        tok = Tokenizer(tok_path)
    else:
        tok, n_docs = _train_tokenizer(documents, vocab_size, val_fraction, tok_path)
    dtype = token_dtype(tok.vocab_size)
    writers: dict[str, ShardWriter] = {}
    counts = np.zeros(tok.vocab_size, dtype=np.int64)
    docs: dict[str, int] = {}
    with Progress("data: tokenizing", n_docs, "documents") as shown, shown.ticking():
        _tokenize(documents, tok, val_fraction, build, writers, counts, docs, shown)
    if not any(p.endswith(".train") for p in writers):
        raise DataError(no_docs_error)
    if not any(p.endswith(".val") for p in writers):
        raise DataError(
            "data.val_fraction: no document fell into the validation split; raise it or add documents"
        )
    shards: dict[str, dict[str, int]] = {}
    for writer in writers.values():
        shards.update(writer.close())
    with (build / "unigram_counts.npy").open("wb") as fh:
        np.save(fh, counts, allow_pickle=False)
    meta = {
        "format": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer_sha256": tok.sha256,
        "input_fingerprint": fingerprint,
        "shards": shards,
        "documents": docs,
        "tokens": {p: sum(s["tokens"] for n, s in shards.items() if n.startswith(p + "-")) for p in writers},
    }
    write_meta(build, meta)
    return meta


def _train_tokenizer(
    documents: Callable[[], Iterable[Doc]], vocab_size: int, val_fraction: float, path: Path
) -> tuple[Tokenizer, int]:
    """Train the tokenizer on the training split of ``documents()``, shown as a phase: on a terminal the
    library's own bar, otherwise a line every few seconds (documents read, then the merges, which the
    library computes in one call). Returns it and the number of documents read."""
    read = 0

    def texts() -> Iterator[str]:
        nonlocal read
        for d in documents():
            read += 1
            if not shown.tty:
                shown.update()
            if not is_validation(d.id, val_fraction):
                yield d.text

    with Progress(f"data: training a {vocab_size}-token BPE tokenizer", unit="documents read") as shown:
        if shown.tty:
            tok = train_tokenizer(texts(), vocab_size, path, show_progress=True)
        else:
            with shown.ticking():
                tok = train_tokenizer(texts(), vocab_size, path)
    return tok, read


def _tokenize(
    documents: Callable[[], Iterable[Doc]],
    tok: Tokenizer,
    val_fraction: float,
    build: Path,
    writers: dict[str, ShardWriter],
    counts: np.ndarray,
    docs: dict[str, int],
    shown: Progress,
) -> None:
    """Every document of ``documents()`` as ``<|endoftext|>`` + its tokens into the shard writer of its
    (domain, split), created on first use; ``counts``: the training split's unigram counts."""
    dtype = token_dtype(tok.vocab_size)
    for batch in batched(documents(), 256):
        encoded = tok.encode_batch([d.text for d in batch])
        for doc, ids in zip(batch, encoded, strict=True):
            split = "val" if is_validation(doc.id, val_fraction) else "train"
            prefix = f"{doc.domain}.{split}"
            if prefix not in writers:
                writers[prefix] = ShardWriter(build, prefix, dtype)
            tokens = np.asarray([tok.eot_id, *ids], dtype=dtype)
            writers[prefix].add(tokens)
            docs[prefix] = docs.get(prefix, 0) + 1
            if split == "train":
                counts += np.bincount(tokens, minlength=tok.vocab_size)
        shown.update(len(batch))
