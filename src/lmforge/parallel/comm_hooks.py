"""DDP gradient compression through torch's communication hooks (``parallel.ddp_comm_hook``), and the bytes
each step hands to the all-reduce.

DDP all-reduces the gradients bucket by bucket (flat buffers of about 25 MB, the first 1 MB) during
backward; a communication hook replaces that all-reduce for each bucket. lmforge registers torch's own
hooks (``torch.distributed.algorithms.ddp_comm_hooks``), wrapped to count what they send:

* ``none``: no hook, DDP's built-in all-reduce of the FP32 buffer. Bytes per step: every gradient DDP
  reduces, ``sum(numel) * 4`` (the buffer's element size: 8 under ``fp64``).
* ``bf16`` / ``fp16``: ``g_avg = cast32(allreduce_sum(cast16(g_r) / W))`` over the ``W`` data-parallel
  ranks: each rank casts its bucket to 16 bits, divides by ``W`` there (exact for a power of two, short
  of underflow), the 16-bit values are summed, and the sum is copied back into the FP32 buffer. Half the
  bytes, ``sum(numel) * 2``; each gradient element loses its mantissa beyond 8 (bf16) or 11 (fp16) bits,
  and fp16 overflows above 65504 (a loss-scaled fp16 run's scaler then skips the step).
* ``powersgd`` (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization"): each gradient ``G`` (as an ``n x m`` matrix, ``m`` the product of its trailing
  dimensions) plus the error this rank left out last time, ``M = G + e``, is approximated by
  ``P Q^T`` of rank ``r``: ``P = allreduce(M Q)``, orthonormalised, ``Q = allreduce(M^T P) / W``, and
  ``M ~ P Q^T``; the new error is ``e = M - P Q^T`` (error feedback). ``Q`` is warm-started from the
  previous step's. A matrix is compressed only when ``n m > min_compression_rate * (n + m) r``; the
  rest (norm weights, biases) is all-reduced whole. Bytes per step: ``(sum (n + m) r + uncompressed) *
  4``. The first ``parallel.powersgd.start_step`` synchronisations are plain FP32 all-reduces.

Bytes are this rank's contribution handed to the collective each step (what a ring all-reduce sends is
``2 (W - 1) / W`` times that, the same factor for every hook): for the 16-bit hooks the bucket's element
count times 2 (the hook casts the whole bucket), for PowerSGD the elements torch's hook all-reduces (its
own ``total_numel_after_compression`` count, which adds ``(n + m) r`` per compressed matrix and
``n m`` per uncompressed tensor), in the bucket's dtype. The metrics record carries the mean over the
steps since the previous record as ``comm_bytes_per_step``.

PowerSGD holds state across steps: the error ``e`` of every gradient (differs by rank), ``Q`` (equal on
every rank), its step counter and random generator (which draws the first ``Q``). torch keys ``e`` and
``Q`` by bucket, as flat buffers, and DDP rebuilds its buckets after a process's first step (in the
order gradients became ready): :class:`PowerSGD` keeps the state by parameter name instead
(:meth:`PowerSGD.state_dict`), cuts it out of the old buckets when the buckets change, and lays it into
the new ones. Every PowerSGD operation is per tensor (the all-reduces are element-wise), so a resumed run
repeats the uninterrupted one bitwise, whatever the bucket layout, once its first compressed step is
behind the checkpoint; a checkpoint taken exactly at ``start_step`` resumes with a fresh random ``Q``
drawn for the resumed process's first buckets. The state is per rank (``comm/rank_N.pt`` in a
checkpoint); a resume with another data-parallel degree starts it afresh (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import ParallelConfig

log = logging.getLogger(__name__)

BucketEntries = tuple[tuple[str, torch.Size], ...]  # a bucket's parameters: names and shapes, in order


def grad_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the gradients DDP all-reduces each step without a hook: ``sum(numel * element size)``."""
    return sum(p.numel() * p.element_size() for p in params)


def _unannotated(hook: Callable) -> Callable:
    """``hook`` as a function without annotations: DDP refuses a hook whose ``bucket`` annotation is not
    ``dist.GradBucket`` itself, and this module's annotations are strings."""

    def call(state, bucket):
        return hook(state, bucket)

    return call


class CommHook:
    """The communication hook of ``parallel.ddp_comm_hook`` on one DDP module, and its byte count.

    :meth:`register` installs it (``none``: nothing, DDP's own all-reduce); :meth:`take_bytes_per_step`
    gives the mean bytes handed to the collective per step since its previous call."""

    def __init__(self, kind: str, group: dist.ProcessGroup | None) -> None:
        self.kind, self.group = kind, group
        self._bytes = 0
        self._steps = 0
        self._plain = 0  # bytes of every reduced gradient (the "none" figure)

    def register(self, ddp: DistributedDataParallel, reduced: list[nn.Parameter]) -> None:
        """Hook ``ddp`` (whose reduced parameters are ``reduced``)."""
        self._plain = grad_bytes(reduced)
        if self.kind != "none":
            ddp.register_comm_hook(None, _unannotated(self._hook))

    def _send(self, bucket: dist.GradBucket) -> tuple[torch.futures.Future, int]:
        """Run the wrapped hook on ``bucket``: its future and the bytes it handed to the collective."""
        buffer = bucket.buffer()
        dtype = torch.bfloat16 if self.kind == "bf16" else torch.float16
        hook = default_hooks.bf16_compress_hook if self.kind == "bf16" else default_hooks.fp16_compress_hook
        return hook(self.group, bucket), buffer.numel() * torch.empty((), dtype=dtype).element_size()

    def _hook(self, _state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        future, sent = self._send(bucket)
        self._bytes += sent
        if bucket.is_last():  # bucket 0, reduced last: one synchronisation done
            self._steps += 1
        return future

    def take_bytes_per_step(self) -> float:
        """Mean bytes this rank handed to the gradient all-reduce per step since the previous call (the
        plain gradient bytes for ``none``)."""
        if self.kind == "none":
            return float(self._plain)
        mean = self._bytes / self._steps if self._steps else 0.0
        self._bytes, self._steps = 0, 0
        return mean

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class PowerSGD(CommHook):
    """torch's ``powerSGD_hook`` with error feedback and warm start, its state kept by parameter name
    (module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, cfg: ParallelConfig, seed: int, world: int) -> None:
        super().__init__("powersgd", group)
        p = cfg.powersgd
        self.world = world
        self.state = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=p.rank,
            start_powerSGD_iter=p.start_step,
            min_compression_rate=p.min_compression_rate,
            use_error_feedback=True,
            warm_start=True,
            random_seed=seed,
        )
        self.names: dict[int, str] = {}  # id(parameter) -> name
        self.layout: dict[int, BucketEntries] = {}  # bucket index -> what its state buffers hold
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # by name, waiting for its bucket
        self._seen: set[int] = set()  # buckets reduced in the current step
        self.relaid = 0  # times DDP's buckets changed under the state (rebuilt after a first step)

    def register(self, ddp: DistributedDataParallel, reduced: list[nn.Parameter]) -> None:
        self.names = {id(p): n for n, p in ddp.module.named_parameters()}
        self._plain = grad_bytes(reduced)
        ddp.register_comm_hook(self.state, _unannotated(self._hook))

    # -- the state's layout: flat buffers per bucket <-> pieces per parameter --------------------------

    def _compressed(self, entries: BucketEntries) -> list[tuple[str, int, int]]:
        """The compressed tensors of a bucket with their ``P`` and ``Q`` lengths (``n r``, ``m r``), in the
        order torch's hook lays them out: grouped by matrix shape, shapes in order of first appearance."""
        groups: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for name, shape in entries:
            n = shape[0] if len(shape) else 1
            m = shape.numel() // n if n else 0
            r = min(n, m, self.state.matrix_approximation_rank)
            if psgd._should_compress(n, m, r, self.state.min_compression_rate)[0]:
                groups.setdefault((n, m), []).append((name, n * r, m * r))
        return [item for group in groups.values() for item in group]

    def _split(self, index: int) -> dict[str, dict[str, torch.Tensor]]:
        """Bucket ``index``'s error and ``Q`` cut into pieces per parameter (copies)."""
        entries, out = self.layout[index], {}
        error = self.state.error_dict.get(index)
        if error is not None:
            offset = 0
            for name, shape in entries:
                out.setdefault(name, {})["error"] = error[offset : offset + shape.numel()].clone()
                offset += shape.numel()
        q = self.state.q_memory_dict.get(index)
        if q is not None:
            offset = 0
            for name, _, length in self._compressed(entries):
                out.setdefault(name, {})["q"] = q[offset : offset + length].clone()
                offset += length
        return out

    def _assemble(self, index: int, entries: BucketEntries, like: torch.Tensor) -> None:
        """Lay the pending pieces of ``entries`` into bucket ``index``'s buffers (those that are complete)."""
        pieces = [self.pending.get(name, {}) for name, _ in entries]
        if entries and all("error" in p for p in pieces):
            self.state.error_dict[index] = torch.cat([p["error"] for p in pieces]).to(like)
        compressed = self._compressed(entries)
        if compressed and all("q" in self.pending.get(name, {}) for name, _, _ in compressed):
            self.state.q_memory_dict[index] = torch.cat([self.pending[n]["q"] for n, _, _ in compressed]).to(
                like
            )
            p_length = sum(p for _, p, _ in compressed)  # P is recomputed each step: storage only
            self.state.p_memory_dict[index] = torch.empty(p_length, dtype=like.dtype, device=like.device)
        elif not compressed and self.state.iter > self.state.start_powerSGD_iter:
            # a bucket with nothing to compress had (empty) factors since the first compressed step: so
            # that torch's hook does not draw a first Q for it again
            self.state.q_memory_dict[index] = like.new_empty(0)
            self.state.p_memory_dict[index] = like.new_empty(0)
        for name, _ in entries:
            self.pending.pop(name, None)

    def _forget(self, index: int) -> None:
        for d in (self.state.error_dict, self.state.p_memory_dict, self.state.q_memory_dict, self.layout):
            d.pop(index, None)

    def _send(self, bucket: dist.GradBucket) -> tuple[torch.futures.Future, int]:
        index, buffer = bucket.index(), bucket.buffer()
        entries = tuple((self.names[id(p)], p.shape) for p in bucket.parameters())
        if index in self.layout and self.layout[index] != entries:  # DDP rebuilt its buckets
            self.relaid += 1
            for old in [i for i in self.layout if i not in self._seen]:
                self.pending.update(self._split(old))
                self._forget(old)
        if index not in self.layout and self.pending:
            self._assemble(index, entries, buffer)
        self.layout[index] = entries
        self._seen.add(index)
        if bucket.is_last():
            self._seen = set()
        plain = self.state.iter < self.state.start_powerSGD_iter
        before = self.state.total_numel_after_compression
        future = psgd.powerSGD_hook(self.state, bucket)
        sent = buffer.numel() if plain else self.state.total_numel_after_compression - before
        return future, sent * buffer.element_size()

    # -- what survives a restart --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's state by parameter name: ``{"iter", "rng", "world", "params": {name: {"error", "q"}}}``
        (copies: a later step does not change a saved state)."""
        params = {name: dict(p) for name, p in self.pending.items()}
        for index in self.layout:
            params.update(self._split(index))
        return {
            "iter": self.state.iter,
            "rng": self.state.rng.get_state(),
            "world": self.world,
            "params": {n: {k: v.cpu() for k, v in p.items()} for n, p in params.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.state.iter = state["iter"]
        self.state.rng.set_state(state["rng"])
        for index in list(self.layout):
            self._forget(index)
        if state["world"] != self.world:
            log.warning(
                "parallel.powersgd: the checkpoint's state is of %d data-parallel ranks, this run has %d: "
                "error feedback and Q start afresh",
                state["world"],
                self.world,
            )
            self.pending = {}
            return
        self.pending = {n: dict(p) for n, p in state["params"].items()}


def comm_hook(cfg: ParallelConfig, group: dist.ProcessGroup | None, seed: int, world: int) -> CommHook:
    """The hook object of ``parallel.ddp_comm_hook`` over the data-parallel ``group`` of ``world`` ranks
    (``seed``: PowerSGD's generator of the first ``Q``, the same on every rank)."""
    if cfg.ddp_comm_hook == "powersgd":
        return PowerSGD(group, cfg, seed, world)
    return CommHook(cfg.ddp_comm_hook, group)
