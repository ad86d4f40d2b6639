"""The tokenizer: lmforge's byte-level BPE, trained and used with Hugging Face ``tokenizers``.

The vocabulary holds the 256 byte symbols, the learned merges and one special token, ``<|endoftext|>``,
which separates (and begins) documents in packed sequences. Encoding of a batch runs on all cores
(the library's Rust thread pool). :class:`Tokenizer` reads any ``tokenizer.json`` with that token (also
the other kinds of :mod:`lmforge.tokenizer.kinds`).

A layer of its own, below ``corpus/`` and ``data/``: both count tokens with it (``lmforge data sweep``
sizes what each strictness level kept; training's data preparation trains it and writes the shards), so
neither has to reach into the other for it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lmforge.errors import DataError

EOT = "<|endoftext|>"


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, path: str | Path, show_progress: bool = False
) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` entries (bytes + merges + EOT) and save it to ``path``;
    ``show_progress``: the library's own bar (on a terminal)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return Tokenizer(path)


class Tokenizer:
    """A saved ``tokenizer.json`` with the few operations lmforge needs."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(
                f"data.tokenizer: {self.path} does not exist; give a tokenizer.json or leave it unset"
            )
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise DataError(f"data.tokenizer: {self.path} is not a tokenizers JSON file ({exc})") from None
        eot = self._tok.token_to_id(EOT)
        if eot is None:
            raise DataError(f"data.tokenizer: {self.path} has no {EOT} token; train one with lmforge")
        self.eot_id: int = eot
        self.vocab_size: int = self._tok.get_vocab_size()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def batched(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
