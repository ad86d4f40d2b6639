"""Preference pairs as training data: tokenised pairs, their batches, the loader and the reference.

A pair is two sequences, ``prompt + chosen`` and ``prompt + rejected``, each rendered by the chat
template into ids and a loss mask (True on the response tokens). A sequence of ``n <= seq_len + 1`` ids
gives the row ``inputs = ids[:-1]``, ``targets = ids[1:]`` (``-100`` where ``mask[1:]`` is False), padded
to ``seq_len`` (``pad_id`` inputs, ``-100`` targets, the padding a document of its own). Every row has the
same width ``seq_len``, so shapes never change between steps (``torch.compile``, memory planning).

A batch of ``k`` pairs is ``2k`` rows: ``[chosen_0 .. chosen_{k-1}, rejected_0 .. rejected_{k-1}]``, one
forward for both halves (one DDP forward per micro-batch). Its ``n_targets`` is ``k``: the training step
divides the summed pair losses by the pairs of the whole step. ``ref_logps`` holds the reference
model's ``log p(response)`` of the same rows, looked up by pair index from the array that
:func:`reference_logps` computed once before training (``dpo.reference = "cached"``).

Order (:class:`PairLoader`, as ``data/loader.py::PackedLoader``): global pair number ``j`` lies in epoch
``e = j // n`` and is pair ``perm_e[j % n]``, ``perm_e`` a permutation drawn from ``(seed, e)``; each
micro-step consumes ``world * micro_batch_size`` pair numbers, rank ``r`` the ``r``-th block. A batch is a
pure function of (seed, position, rank): the state is the position, and a resume is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Self

import numpy as np
import torch
from torch import nn

from lmforge.data.loader import Batch
from lmforge.errors import DataError
from lmforge.precision import PrecisionPolicy
from lmforge.progress import Progress

Render = Callable[[Sequence[Any]], tuple[list[int], list[bool]]]  # turns -> (ids, loss mask)


@dataclass
class PairRows(Batch):
    """``2k`` padded rows, the ``k`` chosen sequences then the ``k`` rejected ones, whose loss is a mean
    over the pairs (DPO's :class:`PairBatch`, the reward model's ``RewardBatch``). A subclass adds its
    per-pair tensors as fields; :meth:`to` moves every tensor field and keeps a None one."""

    @property
    def n_pairs(self) -> int:
        return self.inputs.shape[0] // 2

    @property
    def n_targets(self) -> int:
        """Pairs, not tokens: the loss is a mean over the pairs of the step."""
        return self.n_pairs

    def to(self, device: torch.device) -> Self:
        nb = device.type == "cuda"
        moved = (getattr(self, f.name) for f in fields(self))
        return type(self)(*(None if t is None else t.to(device, non_blocking=nb) for t in moved))


@dataclass
class PairBatch(PairRows):
    """DPO's rows and the reference's log-probabilities of them (``(2k,)`` float32; None when a
    reference model scores the batch instead)."""

    ref_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenizedPair:
    """A pair's two sequences: ids (``<= seq_len + 1``, int64) and loss masks (bool), and the record's
    ``path:line``."""

    chosen_ids: np.ndarray
    chosen_mask: np.ndarray
    rejected_ids: np.ndarray
    rejected_mask: np.ndarray
    source: str


def _fit(ids: list[int], mask: list[bool], seq_len: int, over_length: str, side: str) -> tuple | str:
    """``(ids, mask)`` arrays within ``seq_len + 1`` tokens, or the reason the side is unusable."""
    limit = seq_len + 1
    if len(ids) > limit:
        if over_length == "skip":
            return (
                f"{side}: over the length limit: {len(ids)} tokens > data.seq_len+1 = {limit}; raise "
                f'data.seq_len or set posttrain.over_length = "truncate"'
            )
        ids, mask = ids[:limit], mask[:limit]
    if not any(mask[1:]):
        cut = " within data.seq_len (the prompt fills it)" if len(ids) == limit else ""
        return f"{side}: no response tokens{cut}"
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


def tokenize_pairs(
    pairs: Sequence[Any], render: Render, seq_len: int, over_length: str
) -> tuple[list[TokenizedPair], list[tuple[str, str]]]:
    """Render each pair's ``prompt + chosen`` and ``prompt + rejected`` (any object with ``.prompt``,
    ``.chosen``, ``.rejected`` turn tuples and ``.source``; ``render``: e.g. ``ChatTemplate.render``).

    A side longer than ``seq_len + 1`` tokens is skipped (``over_length = "skip"``, the whole pair) or cut
    at the end (``"truncate"``); a side left without response tokens is skipped either way. Returns the
    pairs kept and ``(source, reason)`` of each pair skipped, in input order.
    """
    if over_length not in ("skip", "truncate"):
        raise ValueError(f"over_length must be 'skip' or 'truncate', not {over_length!r}")
    kept: list[TokenizedPair] = []
    skipped: list[tuple[str, str]] = []
    for pair in pairs:
        prompt = tuple(pair.prompt)
        chosen = _fit(*render(prompt + tuple(pair.chosen)), seq_len, over_length, "chosen")
        rejected = _fit(*render(prompt + tuple(pair.rejected)), seq_len, over_length, "rejected")
        reasons = [r for r in (chosen, rejected) if isinstance(r, str)]
        if reasons:
            skipped.append((pair.source, "; ".join(reasons)))
        else:
            kept.append(TokenizedPair(*chosen, *rejected, pair.source))
    return kept, skipped


def pair_row(ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int = 0) -> tuple[np.ndarray, ...]:
    """``(inputs, targets, doc_ids)`` of one sequence, padded to ``seq_len``: targets ``-100`` off the
    response and on padding; doc id 0 for the sequence, 1 for its padding."""
    n = len(ids) - 1
    inputs = np.full(seq_len, pad_id, dtype=np.int64)
    targets = np.full(seq_len, -100, dtype=np.int64)
    docs = np.ones(seq_len, dtype=np.int64)
    inputs[:n] = ids[:-1]
    targets[:n] = np.where(mask[1:], ids[1:], -100)
    docs[:n] = 0
    return inputs, targets, docs


PAD_MULTIPLE = 64


def row_width(longest: int, seq_len: int) -> int:
    """``min(seq_len, PAD_MULTIPLE * ceil(longest / PAD_MULTIPLE))``: the padded length of a batch whose
    longest sequence has ``longest`` input tokens."""
    return min(seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)


def stack_pairs(
    pairs: Sequence[TokenizedPair],
    seq_len: int,
    pad_id: int = 0,
    ref: np.ndarray | None = None,
) -> PairBatch:
    """The batch of ``pairs`` (chosen rows, then rejected rows); ``ref``: their reference log-probs,
    ``(k, 2)`` as (chosen, rejected). Rows are padded to :func:`row_width` of the longest sequence, not to
    ``seq_len``: short pairs cost no compute on padding, and compile sees a handful of shapes."""
    longest = max(max(len(p.chosen_ids), len(p.rejected_ids)) - 1 for p in pairs)
    width = row_width(longest, seq_len)
    rows = [pair_row(p.chosen_ids, p.chosen_mask, width, pad_id) for p in pairs]
    rows += [pair_row(p.rejected_ids, p.rejected_mask, width, pad_id) for p in pairs]
    cols = [torch.from_numpy(np.stack(col)) for col in zip(*rows, strict=True)]
    ref_t = None
    if ref is not None:
        ref_t = torch.from_numpy(np.concatenate([ref[:, 0], ref[:, 1]]).astype(np.float32))
    return PairBatch(*cols, ref_t)


def check_reference(ref: np.ndarray, n_pairs: int) -> np.ndarray:
    """``ref`` as a ``(n_pairs, 2)`` float32 array, or a ``DataError`` naming the mismatch."""
    ref = np.asarray(ref, dtype=np.float32)
    if ref.shape != (n_pairs, 2):
        raise DataError(
            f"dpo.reference: the cached reference log-probabilities have shape {ref.shape}, the pairs need "
            f"({n_pairs}, 2); delete the cache to recompute it"
        )
    return ref


class PairLoader:
    """Shuffled pair batches for training (``TrainLoader`` of ``data/loader.py``); resumable via
    ``state_dict``. ``micro_batch_size`` counts pairs (``2 * micro_batch_size`` rows)."""

    def __init__(
        self,
        pairs: Sequence[TokenizedPair],
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        pad_id: int = 0,
    ):
        if not pairs:
            raise DataError("posttrain.train_files: no usable preference pairs; check the records")
        self.pairs, self.seq_len, self.mbs = list(pairs), seq_len, micro_batch_size
        self.seed, self.rank, self.world, self.pad_id = seed, rank, world, pad_id
        self.n_pairs = len(self.pairs)
        self.position = 0  # global pair number of the next micro-step, over all ranks
        self.ref: np.ndarray | None = None
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def set_reference(self, ref: np.ndarray) -> None:
        """The reference's log-probabilities of every pair, ``(n_pairs, 2)``: (chosen, rejected)."""
        self.ref = check_reference(ref, self.n_pairs)

    def _pair_of(self, j: int) -> int:
        epoch, i = divmod(j, self.n_pairs)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_pairs)
            self._perm_epoch = epoch
        return int(self._perm[i])

    @property
    def epoch(self) -> float:
        return self.position / self.n_pairs

    def next_batch(self) -> PairBatch:
        first = self.position + self.rank * self.mbs
        index = np.array([self._pair_of(j) for j in range(first, first + self.mbs)])
        self.position += self.world * self.mbs
        ref = None if self.ref is None else self.ref[index]
        return stack_pairs([self.pairs[i] for i in index], self.seq_len, self.pad_id, ref)

    def __iter__(self) -> Iterator[PairBatch]:
        while True:
            yield self.next_batch()

    def report(self) -> dict[str, float | int | str]:
        """Nothing beyond the step's ``epoch``."""
        return {}

    def summary(self) -> dict:
        return {"train_pairs": self.n_pairs}

    def state_dict(self) -> dict:
        return {
            "kind": "pairs",
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "world": self.world,
            "n_pairs": self.n_pairs,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "pairs":
            raise DataError(
                "train.objective: the checkpoint was not trained on preference pairs (lmforge dpo)"
            )
        if state["seq_len"] != self.seq_len:
            raise DataError(f"data.seq_len: checkpoint used {state['seq_len']}, config has {self.seq_len}")
        if state["n_pairs"] != self.n_pairs:
            raise DataError(
                f"posttrain.train_files: the checkpoint was trained on {state['n_pairs']} pairs, these files "
                f"give {self.n_pairs}; resume with the same records"
            )
        self.seed = state["seed"]
        self.position = int(state["position"])


def pair_eval_batches(
    pairs: Sequence[TokenizedPair],
    seq_len: int,
    batch_size: int,
    ref: np.ndarray | None = None,
    rank: int = 0,
    world: int = 1,
    pad_id: int = 0,
) -> Iterator[PairBatch]:
    """Every pair once, in order, ``batch_size`` pairs a batch (the last may be smaller); rank ``r`` of
    ``world`` takes pairs ``r, r + world, ...``. ``ref``: the ``(n_pairs, 2)`` reference log-probs."""
    mine = np.arange(rank, len(pairs), world)
    for start in range(0, len(mine), batch_size):
        index = mine[start : start + batch_size]
        yield stack_pairs([pairs[i] for i in index], seq_len, pad_id, None if ref is None else ref[index])


@torch.no_grad()
def reference_logps(
    logps: nn.Module | Callable[..., torch.Tensor],
    pairs: Sequence[TokenizedPair],
    seq_len: int,
    batch_size: int,
    precision: PrecisionPolicy,
    rank: int = 0,
    world: int = 1,
) -> np.ndarray:
    """``log p(response)`` of every pair under ``logps`` (a :class:`~lmforge.posttrain.dpo.SequenceLogps`
    of the starting model), computed once: no gradients, eval mode, the run's autocast (the policy's
    first step computes in the same precision, so its margin starts at 0). Returns ``(n_pairs, 2)``
    float32 (chosen, rejected). Rank ``r`` of ``world`` fills its pairs (as :func:`pair_eval_batches`)
    and leaves zeros elsewhere: a sum over ranks (``all_reduce``) gives the whole array. Shown as a
    phase (pairs done, rate, time left): thousands of pairs take minutes on a CPU."""
    out = np.zeros((len(pairs), 2), dtype=np.float32)
    was_training = getattr(logps, "training", False)
    if isinstance(logps, nn.Module):
        logps.eval()
    index = np.arange(rank, len(pairs), world)
    done = 0
    with Progress("DPO reference log-probabilities", len(index), "pairs") as shown, shown.ticking():
        for batch in pair_eval_batches(pairs, seq_len, batch_size, None, rank, world):
            batch = batch.to(precision.device)
            with precision.autocast():
                lp = logps(batch.inputs, batch.targets, batch.doc_ids).float().cpu().numpy()
            k = batch.n_pairs
            out[index[done : done + k], 0] = lp[:k]
            out[index[done : done + k], 1] = lp[k:]
            done += k
            shown.update(k)
    if isinstance(logps, nn.Module):
        logps.train(was_training)
    return out
