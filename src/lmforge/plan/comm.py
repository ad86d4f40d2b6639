"""Communication volume per optimizer step and device, by layout (bytes each device sends; ring
collectives receive as much).

Ring collectives over ``n`` ranks on ``X`` bytes (each rank's full buffer): all-reduce sends
``2 (n - 1) / n * X`` (a reduce-scatter then an all-gather), reduce-scatter and all-gather
``(n - 1) / n * X`` each (Patarasuk & Yuan 2009; the NCCL tests' "bus bandwidth" convention).

Data parallelism, in units of the parameter count ``P`` (``n`` large, so ``(n - 1)/n ~ 1``); the seed
table / ZeRO paper (section 7): DDP all-reduces the gradients, ``2P``; ZeRO-1 and ZeRO-2 reduce-scatter
the gradients and all-gather the updated parameters, ``2P``; ZeRO-3 all-gathers the parameters in forward
and again in backward and reduce-scatters the gradients, ``3P``. :func:`dp_volume` gives these exactly, in
bytes, with the dtypes lmforge uses: gradients reduced in FP32 (``g = 4``), parameters gathered in the
compute dtype (``c``); FSDP2 gathers and reduces per micro-batch (``a`` micro-batches per step), DDP only
on the last; ZeRO-1 is lmforge's DDP all-reduce plus ``ZeroRedundancyOptimizer``'s broadcast of the
updated FP32 parameters; under lmforge's ZeRO-3 the root unit is gathered once (kept from forward to
backward) and ZeRO-2 gathers everything once per micro-batch.

Tensor parallelism with sequence parallelism (Korthikanti et al. 2022): per block and micro-batch two
all-gathers and two reduce-scatters of the ``b x T x d`` activations in forward and as many in backward,
``8 (t - 1)/t * b T d c`` bytes; the output head's logits are all-gathered, ``(t - 1)/t * b T V c`` in
forward and again for their gradient in backward. A full-recompute policy adds the forward's four again.

Pipeline parallelism: each micro-batch's ``b x T x d`` activation goes to the next stage and its gradient
comes back, ``2 * b T d c`` bytes per pipeline micro-batch sent by an inner stage. A tied embedding held
by the first and the last stage on two ranks (``parallel/tied_embedding.py``) adds, on those two ranks,
one all-reduce of the copy's FP32 gradient (this rank's shard) per step: :func:`tied_volume`.
"""

from __future__ import annotations

from dataclasses import dataclass


def all_reduce(x: float, n: int) -> float:
    """Bytes a rank sends in a ring all-reduce of ``x`` bytes: ``2 (n - 1) / n * x``."""
    return 2 * (n - 1) / n * x if n > 1 else 0.0


def reduce_scatter(x: float, n: int) -> float:
    """Bytes a rank sends in a ring reduce-scatter (or all-gather) of ``x`` bytes: ``(n - 1) / n * x``."""
    return (n - 1) / n * x if n > 1 else 0.0


all_gather = reduce_scatter


def seed_volume(kind: str, p: float) -> float:
    """The seed table in parameter units: DDP, ZeRO-1, ZeRO-2 ``2P``; ZeRO-3 ``3P`` (``n`` large)."""
    return {"ddp": 2 * p, "zero1": 2 * p, "zero2": 2 * p, "zero3": 3 * p}[kind]


def dp_volume(
    kind: str,
    p_local: float,
    n: int,
    compute_bytes: int,
    accum: int = 1,
    root: float = 0.0,
    replicas: int = 1,
    accounting: str = "lmforge",
) -> float:
    """Bytes per step and device of data parallelism over ``n`` sharding ranks (``replicas`` copies of
    them; DDP: ``n`` replicas of one), for a device holding ``p_local`` parameters (its TP/PP part).

    ``ddp``: ``all_reduce(g P, n)``; ``zero1``: that plus ``all_gather(4 P, n)`` (lmforge) or
    ``reduce_scatter(g P) + all_gather(c P)`` (zero-paper); ``zero2``: ``a * (all_gather(c P) +
    reduce_scatter(g P))``; ``zero3``: ``a * (all_gather(c P) + all_gather(c (P - R)) + reduce_scatter(g
    P))`` with ``R`` the root's parameters; hybrid sharding all-reduces each shard's gradient over the
    ``replicas`` (``all_reduce(g P / n, replicas)``). ``g``: 4 (lmforge), 2 (zero-paper, 16-bit gradients
    reduced in 16 bits, no accumulation term: the paper's one micro-batch).
    """
    g = 4 if accounting == "lmforge" else 2
    c = compute_bytes if accounting == "lmforge" else 2
    a = accum if accounting == "lmforge" else 1
    if kind == "none":
        return 0.0
    if kind == "ddp":
        return all_reduce(g * p_local, n * replicas)
    if kind == "zero1":
        if accounting == "lmforge":
            return all_reduce(g * p_local, n * replicas) + all_gather(4 * p_local, n)
        return reduce_scatter(g * p_local, n) + all_gather(c * p_local, n)
    hybrid = all_reduce(g * p_local / n, replicas)
    if kind == "zero2":
        return a * (all_gather(c * p_local, n) + reduce_scatter(g * p_local, n)) + hybrid
    if kind == "zero3":
        backward_gather = p_local - (root if accounting == "lmforge" else 0.0)
        return (
            a
            * (
                all_gather(c * p_local, n)
                + all_gather(c * backward_gather, n)
                + reduce_scatter(g * p_local, n)
            )
            + hybrid
        )
    raise ValueError(f"unknown data-parallel kind {kind!r}")


def tp_volume(
    tp: int,
    layers: int,
    tokens: int,
    d_model: int,
    vocab_size: int,
    compute_bytes: int,
    recompute: float = 0.0,
    head: bool = True,
) -> float:
    """Bytes per device of tensor parallelism for ``tokens`` (= b x T summed over the step's
    micro-batches): ``(8 + 4 r) (t - 1)/t * tokens * d * c`` per block (``r`` the recomputed share of
    forwards) plus ``2 (t - 1)/t * tokens * V * c`` for the head's logits."""
    if tp == 1:
        return 0.0
    frac = (tp - 1) / tp
    blocks = (8 + 4 * recompute) * frac * tokens * d_model * compute_bytes * layers
    return blocks + (2 * frac * tokens * vocab_size * compute_bytes if head else 0.0)


def pp_volume(pp: int, tokens: int, d_model: int, compute_bytes: int) -> float:
    """Bytes an inner pipeline stage sends per step: the activation forward and its gradient back for
    every token, ``2 * tokens * d * c`` (0 without a pipeline)."""
    return 2.0 * tokens * d_model * compute_bytes if pp > 1 else 0.0


def tied_volume(grad_bytes: float) -> float:
    """Bytes a rank holding one end of a tied embedding sends per step: the all-reduce of its copy's
    gradient (``grad_bytes`` on this rank) with the other end's, ``all_reduce(X, 2) = X``."""
    return all_reduce(grad_bytes, 2)


@dataclass(frozen=True)
class CommVolume:
    """Bytes per optimizer step and device."""

    dp: float
    tp: float
    pp: float

    @property
    def total(self) -> float:
        """``dp + tp + pp``."""
        return self.dp + self.tp + self.pp
