"""SFT examples as training rows: tokenising, packing or padding, the resumable loader, evaluation.

An example of ``n`` rendered ids gives ``n - 1`` positions: ``inputs = ids[:-1]``, ``targets = ids[1:]``
where ``mask[1:]`` is True and ``-100`` elsewhere, so only response tokens (and their ``<|end|>``) are
learned. A row of ``seq_len`` positions holds one example and padding (``pad``) or several examples back to
back and padding (``pack``); each example has its own document id in the row, the padding one more, so the
document-masked model sees every example as if alone. No target ever crosses from one example into the
next (each example's segment predicts only its own tokens) and padding targets are ``-100``.

Order (as :class:`lmforge.data.loader.PackedLoader`): epoch ``e`` shuffles the examples with a permutation
drawn from ``(seed, e)`` and lays them into rows (``pack``: greedily, the next example opens a new row when
it does not fit); global row number ``k`` runs through the epochs' rows one epoch after the other. Every
micro-step consumes ``world * micro_batch_size`` consecutive row numbers and rank ``r`` takes the ``r``-th
block, so a batch is a pure function of (seed, position, rank) and the loader's state is its position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmforge.data.loader import Batch
from lmforge.errors import DataError
from lmforge.posttrain.records import BadRecord, Example
from lmforge.posttrain.template import ChatTemplate

IGNORE = -100


@dataclass
class Tokenized:
    ids: np.ndarray  # (n,) int64 rendered conversation
    mask: np.ndarray  # (n,) bool, True on tokens the loss counts
    source: str


def tokenize_examples(
    examples: Sequence[Example], template: ChatTemplate, seq_len: int, over_length: str
) -> tuple[list[Tokenized], list[BadRecord]]:
    """Render each example; one longer than ``seq_len + 1`` ids is skipped (a :class:`BadRecord`) or, with
    ``over_length = "truncate"``, cut to its first ``seq_len + 1`` ids (a BadRecord when no response token
    is left)."""
    if over_length not in ("skip", "truncate"):
        raise ValueError(f"over_length must be skip or truncate, not {over_length!r}")
    good: list[Tokenized] = []
    bad: list[BadRecord] = []
    limit = seq_len + 1
    for ex in examples:
        ids, mask = template.render(ex.turns)
        if len(ids) > limit:
            if over_length == "skip":
                bad.append(
                    BadRecord(
                        ex.source,
                        f"over the length limit: {len(ids)} tokens > data.seq_len + 1 = {limit}; raise "
                        "data.seq_len or set posttrain.over_length = 'truncate'",
                    )
                )
                continue
            ids, mask = ids[:limit], mask[:limit]
            if not any(mask[1:]):
                bad.append(
                    BadRecord(
                        ex.source,
                        f"no response token within the length limit (data.seq_len + 1 = {limit}) after "
                        "truncation; raise data.seq_len",
                    )
                )
                continue
        good.append(Tokenized(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool), ex.source))
    return good, bad


def example_row(ex: Tokenized) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one example: ``ids[:-1]`` and ``ids[1:]`` with ``-100`` where ``mask[1:]`` is
    False."""
    targets = np.where(ex.mask[1:], ex.ids[1:], IGNORE)
    return ex.ids[:-1], targets


def pack_rows(lengths: Sequence[int], seq_len: int, packing: str) -> list[list[int]]:
    """Indices into ``lengths`` (positions each example takes) grouped into rows of at most ``seq_len``,
    in the given order: ``pad`` one a row; ``pack`` next-fit (a new row when the next does not fit)."""
    if packing == "pad":
        return [[i] for i in range(len(lengths))]
    if packing != "pack":
        raise ValueError(f"packing must be pack or pad, not {packing!r}")
    rows: list[list[int]] = []
    used = seq_len + 1  # no open row yet
    for i, n in enumerate(lengths):
        if used + n > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def build_row(
    examples: Sequence[Tokenized], seq_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, targets, doc_ids) of one row: the examples back to back (doc ids 0, 1, ...), then padding
    (pad_id inputs, -100 targets, the next doc id)."""
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    doc_ids = np.full(seq_len, len(examples), dtype=np.int64)
    at = 0
    for d, ex in enumerate(examples):
        x, y = example_row(ex)
        if at + len(x) > seq_len:
            raise ValueError(f"{ex.source}: examples of {at + len(x)} positions exceed the row of {seq_len}")
        inputs[at : at + len(x)] = x
        targets[at : at + len(x)] = y
        doc_ids[at : at + len(x)] = d
        at += len(x)
    return inputs, targets, doc_ids


def _stack(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Batch:
    return Batch(*(torch.from_numpy(np.stack(col)) for col in zip(*rows, strict=True)))


class SFTLoader:
    """Shuffled SFT rows for training (:class:`lmforge.data.loader.TrainLoader`); resumable via
    ``state_dict``."""

    def __init__(
        self,
        examples: list[Tokenized],
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        packing: str,
        rank: int = 0,
        world: int = 1,
        pad_id: int = 0,
    ):
        if not examples:
            raise DataError("posttrain.train_files: no usable SFT example; fix the records reported above")
        self.examples, self.seq_len, self.mbs = examples, seq_len, micro_batch_size
        self.seed, self.packing, self.rank, self.world, self.pad_id = seed, packing, rank, world, pad_id
        self.lengths = np.array([len(ex.ids) - 1 for ex in examples], dtype=np.int64)
        if int(self.lengths.max()) > seq_len:
            raise ValueError(
                f"an example of {int(self.lengths.max()) + 1} ids exceeds seq_len + 1; tokenize first"
            )
        self.position = 0
        self._epochs: dict[int, list[list[int]]] = {}  # epoch -> rows as example indices
        self._starts = [0]  # first global row number of each epoch laid out so far

    def epoch_rows(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epochs:
            if len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            rows = pack_rows(self.lengths[order].tolist(), self.seq_len, self.packing)
            self._epochs[epoch] = [[int(order[i]) for i in row] for row in rows]
        return self._epochs[epoch]

    def _locate(self, k: int) -> tuple[int, int]:
        """(epoch, row within it) of global row number ``k``."""
        while self._starts[-1] <= k:
            e = len(self._starts) - 1
            self._starts.append(self._starts[-1] + len(self.epoch_rows(e)))
        e = int(np.searchsorted(self._starts, k, side="right")) - 1
        return e, k - self._starts[e]

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        e, i = self._locate(k)
        return build_row([self.examples[j] for j in self.epoch_rows(e)[i]], self.seq_len, self.pad_id)

    @property
    def epoch(self) -> float:
        e, i = self._locate(self.position)
        return e + i / len(self.epoch_rows(e))

    def next_batch(self) -> Batch:
        first = self.position + self.rank * self.mbs
        batch = _stack([self.row(k) for k in range(first, first + self.mbs)])
        self.position += self.world * self.mbs
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def report(self) -> dict[str, float | int | str]:
        """Nothing beyond the step's ``epoch`` and target count."""
        return {}

    def summary(self) -> dict[str, dict[str, float | int]]:
        """As the mixture loader's one domain, ``sft``: rows drawn (all ranks), epochs, rows of the first
        epoch; and the examples and the share of the first epoch's row positions that are learned."""
        rows = self.epoch_rows(0)
        learned = int(sum(int(ex.mask[1:].sum()) for ex in self.examples))
        return {
            "sft": {
                "sequences": self.position,
                "epochs": self.epoch,
                "windows": len(rows),
                "examples": len(self.examples),
                "target_fraction": learned / (len(rows) * self.seq_len),
            }
        }

    def state_dict(self) -> dict:
        return {
            "kind": "sft",
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "world": self.world,
            "packing": self.packing,
            "examples": len(self.examples),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "sft":
            raise DataError(
                "train.objective: the checkpoint was not trained with SFT rows; resume with its data"
            )
        if state["seq_len"] != self.seq_len:
            raise DataError(f"data.seq_len: checkpoint used {state['seq_len']}, config has {self.seq_len}")
        if state["packing"] != self.packing:
            raise DataError(
                f"posttrain.packing: checkpoint used {state['packing']}, config has {self.packing}"
            )
        if state["examples"] != len(self.examples):
            raise DataError(
                f"posttrain.train_files: checkpoint read {state['examples']} examples, now "
                f"{len(self.examples)}; resume with the same records"
            )
        self.seed = state["seed"]
        self._epochs.clear()
        self._starts = [0]
        self.position = int(state["position"])


def sft_eval_batches(
    examples: Sequence[Tokenized],
    seq_len: int,
    batch_size: int,
    packing: str,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
) -> Iterator[Batch]:
    """Held-out examples in order, every one exactly once, in rows (packed or padded), rows split across
    ranks (rank ``r`` takes rows ``r, r + world, ...``)."""
    rows = pack_rows([len(ex.ids) - 1 for ex in examples], seq_len, packing)
    mine = rows[rank::world]
    for start in range(0, len(mine), batch_size):
        chunk = mine[start : start + batch_size]
        yield _stack([build_row([examples[i] for i in row], seq_len, pad_id) for row in chunk])
