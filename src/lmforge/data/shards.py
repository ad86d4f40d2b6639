"""Token shard format: flat token files plus document-boundary indexes, read by memory map.

A shard folder holds, per shard, ``NAME.bin`` (the tokens of its documents back to back, ``uint16`` when
the vocabulary fits in 16 bits, else ``uint32``) and ``NAME.idx`` (a ``.npy`` array of ``int64`` offsets,
``n_docs + 1`` long: document ``i`` spans ``tokens[idx[i]:idx[i + 1]]``), and one ``meta.json`` that
lists the shards with their token and document counts, the dtype and the tokenizer hash. ``meta.json``
is written last, so a folder without it is incomplete.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import DataError


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends documents to ``PREFIX-00000.bin`` and rolls over to a new shard past ``max_tokens``."""

    def __init__(self, folder: Path, prefix: str, dtype: np.dtype, max_tokens: int = 2**28):
        self.folder, self.prefix, self.dtype, self.max_tokens = folder, prefix, dtype, max_tokens
        self.shards: dict[str, dict[str, int]] = {}
        self._fh = None
        self._offsets: list[int] = [0]
        self._name = ""

    def _open(self) -> None:
        self._name = f"{self.prefix}-{len(self.shards):05d}"
        self._fh = (self.folder / f"{self._name}.bin").open("wb")
        self._offsets = [0]
        self.shards[self._name] = {"tokens": 0, "docs": 0}

    def add(self, tokens: np.ndarray) -> None:
        if self._fh is None or self._offsets[-1] >= self.max_tokens:
            self._close_current()
            self._open()
        assert self._fh is not None
        self._fh.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + len(tokens))

    def _close_current(self) -> None:
        if self._fh is None:
            return
        self._fh.close()
        self._fh = None
        np.save(
            self.folder / f"{self._name}.idx", np.asarray(self._offsets, dtype=np.int64), allow_pickle=False
        )
        os.replace(self.folder / f"{self._name}.idx.npy", self.folder / f"{self._name}.idx")
        self.shards[self._name] = {"tokens": self._offsets[-1], "docs": len(self._offsets) - 1}

    def close(self) -> dict[str, dict[str, int]]:
        self._close_current()
        return self.shards


@dataclass
class Shard:
    """One memory-mapped shard."""

    tokens: np.ndarray  # memmap of token ids
    offsets: np.ndarray  # int64 document boundaries, n_docs + 1

    @classmethod
    def open(cls, folder: Path, name: str, dtype: np.dtype) -> Shard:
        bin_path, idx_path = folder / f"{name}.bin", folder / f"{name}.idx"
        if not bin_path.is_file() or not idx_path.is_file():
            raise DataError(f"{bin_path}: shard file missing; delete {folder} to rebuild it")
        size = bin_path.stat().st_size
        tokens = np.memmap(bin_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        with idx_path.open("rb") as fh:
            offsets = np.load(fh, allow_pickle=False)
        if offsets[-1] != len(tokens):
            raise DataError(f"{bin_path}: index and token file disagree; delete {folder} to rebuild it")
        return cls(tokens, offsets)


def write_meta(folder: Path, meta: dict[str, Any]) -> None:
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, folder / "meta.json")


def read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "meta.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def open_shards(folder: Path, names: list[str]) -> list[Shard]:
    meta = read_meta(folder)
    if meta is None:
        raise DataError(f"{folder}: no meta.json (incomplete shard folder); delete it to rebuild")
    dtype = np.dtype(meta["dtype"])
    return [Shard.open(folder, name, dtype) for name in names]
