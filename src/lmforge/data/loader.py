"""Packing token shards into fixed-length training sequences.

The shards of a split are viewed as one token stream (documents back to back, each starting with
``<|endoftext|>``). The stream is cut into ``n = (N - 1) // L`` windows of ``L + 1`` tokens; window
``c`` covers ``stream[c*L : c*L + L + 1]`` and gives ``inputs = w[:-1]``, ``targets = w[1:]`` and the
document index of every input token (for document-masked attention).

Order: global sequence number ``k`` lies in epoch ``e = k // n`` and maps to window
``perm_e[k % n]``, where ``perm_e`` is a permutation drawn from ``(seed, e)``. Every optimizer step
consumes ``world * micro_batch_size`` consecutive sequence numbers per micro-step; rank ``r`` takes the
``r``-th block of them. So a batch is a pure function of (seed, position, rank), and the loader's state
is just its position.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from lmforge.data.shards import Shard
from lmforge.errors import DataError


class TokenStream:
    """Several shards read as one flat token stream with global document indices."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(s.tokens) for s in shards])
        doc_counts = [len(s.offsets) - 1 for s in shards]
        self.doc_starts = np.cumsum([0, *doc_counts])
        self.total = int(self.starts[-1])

    def __len__(self) -> int:
        return self.total

    def tokens(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while filled < length:
            shard = self.shards[i]
            local = pos - int(self.starts[i])
            take = min(length - filled, len(shard.tokens) - local)
            out[filled : filled + take] = shard.tokens[local : local + take]
            filled += take
            pos += take
            i += 1
        return out

    def doc_index(self, start: int, length: int) -> np.ndarray:
        """Global document index of each token in ``[start, start + length)``."""
        pos = np.arange(start, start + length, dtype=np.int64)
        shard = np.searchsorted(self.starts, pos, side="right") - 1
        out = np.empty(length, dtype=np.int64)
        for i in np.unique(shard):
            sel = shard == i
            local = pos[sel] - self.starts[i]
            out[sel] = np.searchsorted(self.shards[i].offsets, local, side="right") - 1 + self.doc_starts[i]
        return out


@dataclass
class Batch:
    inputs: torch.Tensor  # (B, L) int64
    targets: torch.Tensor  # (B, L) int64
    doc_ids: torch.Tensor  # (B, L) int64, global document index of each input token

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(*(t.to(device, non_blocking=nb) for t in (self.inputs, self.targets, self.doc_ids)))

    @property
    def n_targets(self) -> int:
        return int((self.targets != -100).sum())


def window(stream: TokenStream, c: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    w = stream.tokens(c * seq_len, seq_len + 1)
    return w[:-1], w[1:], stream.doc_index(c * seq_len, seq_len)


def stack(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Batch:
    return Batch(*(torch.from_numpy(np.stack(col)) for col in zip(*rows, strict=True)))


class TrainLoader(Protocol):
    """What training reads: a resumable source of micro-batches (plain :class:`PackedLoader` or the
    mixture loader of ``mixture.py``)."""

    position: int  # global sequence number of the next micro-step, over all ranks

    @property
    def epoch(self) -> float: ...

    def next_batch(self) -> Batch: ...

    def report(self) -> dict[str, float | int | str]:
        """Metrics since the previous report (merged into the step's metrics line)."""
        ...

    def summary(self) -> dict:
        """What the run summary records about the data read."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class PackedLoader:
    """Shuffled packed sequences for training; resumable via ``state_dict``."""

    def __init__(
        self,
        stream: TokenStream,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ):
        self.stream, self.seq_len, self.mbs = stream, seq_len, micro_batch_size
        self.seed, self.rank, self.world = seed, rank, world
        self.n_windows = (len(stream) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"data.seq_len: {seq_len} exceeds the {len(stream)} training tokens; lower it")
        self.position = 0  # global sequence number of the next micro-step, over all ranks
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _window_of(self, k: int) -> int:
        epoch, i = divmod(k, self.n_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    @property
    def epoch(self) -> float:
        return self.position / self.n_windows

    def next_batch(self) -> Batch:
        first = self.position + self.rank * self.mbs
        rows = [window(self.stream, self._window_of(k), self.seq_len) for k in range(first, first + self.mbs)]
        self.position += self.world * self.mbs
        return stack(rows)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def report(self) -> dict[str, float | int | str]:
        """Nothing beyond the step's ``epoch``: one stream, no mix to report."""
        return {}

    def summary(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len, "world": self.world}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") == "mixture":
            raise DataError(
                "data.weights: the checkpoint was trained with a mixture (data.weights / data.phases); "
                "resume with the same data settings"
            )
        if state["seq_len"] != self.seq_len:
            raise DataError(f"data.seq_len: checkpoint used {state['seq_len']}, config has {self.seq_len}")
        self.seed = state["seed"]
        self.position = int(state["position"])


def eval_batches(
    stream: TokenStream, seq_len: int, batch_size: int, max_tokens: int, rank: int = 0, world: int = 1
) -> Iterator[Batch]:
    """The first ``max_tokens // seq_len`` windows of a stream, in order, split across ranks."""
    n = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    mine = list(range(rank, n, world))
    for start in range(0, len(mine), batch_size):
        yield stack([window(stream, c, seq_len) for c in mine[start : start + batch_size]])
