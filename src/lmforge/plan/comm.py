"""Communication volume per optimizer step and device, by layout (bytes each device sends; ring
collectives receive as much).

Ring collectives over ``n`` ranks on ``X`` bytes (each rank's full buffer): all-reduce sends
``2 (n - 1) / n * X`` (a reduce-scatter then an all-gather), reduce-scatter and all-gather
``(n - 1) / n * X`` each (Patarasuk & Yuan 2009; the NCCL tests' "bus bandwidth" convention).

Data parallelism, in units of the parameter count ``P`` (``n`` large, so ``(n - 1)/n ~ 1``); the seed
table / ZeRO paper (section 7): DDP all-reduces the gradients, ``2P``; ZeRO-1 and ZeRO-2 reduce-scatter
the gradients and all-gather the updated parameters, ``2P``; ZeRO-3 all-gathers the parameters in forward
and again in backward and reduce-scatters the gradients, ``3P``. :func:`dp_volume` gives these exactly, in
bytes, with the dtypes lmforge uses (gradients reduced in FP32, ``g = 4``; parameters gathered in the
compute dtype, ``c``) and the collectives lmforge's runtime issues per optimizer step of ``a``
micro-batches (:func:`dp_collectives`, ``parallel/data_parallel.py::GradientSync``):

* DDP (also under ZeRO-1): one all-reduce of the gradients per step (``no_sync`` before the last
  micro-batch); ZeRO-1 adds ``ZeroRedundancyOptimizer``'s broadcast of the updated FP32 parameters.
* FSDP2 ZeRO-2: the parameters gathered for the first forward stay gathered through every micro-batch of
  the step: one all-gather per step.
* FSDP2 ZeRO-3: an all-gather for each forward and another for each backward (the root unit, kept
  gathered from forward to backward, once per micro-batch).
* FSDP2 reduce-scatters each unit's gradients in every micro-batch, or once per step with
  ``parallel.defer_grad_sync`` (the unsharded FP32 gradients accumulate locally until the last one).
  Hybrid sharding all-reduces each reduced shard over the ``replicas``, as often.
* FSDP2 on a pipeline stage: the schedule keeps gradients unsharded over its pipeline micro-batches and
  reduces once per schedule step (one per step's micro-batch), and keeps each unit gathered after its
  backward; ZeRO-3's forward gathers again for every pipeline micro-batch (``m``), and its backward too
  under the schedules that alternate forwards and backwards (1F1B and the others; GPipe's backwards run
  back to back: once).

Tensor parallelism with sequence parallelism (Korthikanti et al. 2022): per block and micro-batch two
all-gathers and two reduce-scatters of the ``b x T x d`` activations in forward and as many in backward,
``8 (t - 1)/t * b T d c`` bytes. The output head: with the fused, vocabulary-parallel loss
(``model/fused_loss.py``), the final norm's FP32 output is all-gathered for the head, each token's
softmax statistics (its maximum in FP32, then the sum of exponentials and the target's logit in FP64:
``VOCAB_PARALLEL_STATS`` bytes) are all-reduced, and the hidden states' FP32 gradient, a partial sum
over each rank's vocabulary rows, is all-reduced once: ``(t - 1)/t * 4 b T d + all_reduce(4 b T d) +
all_reduce(20 b T)``; with the chunked loss the logits were all-gathered instead, ``(t - 1)/t * b T V c``
in forward and again for their gradient in backward. A full-recompute policy adds the blocks' forward four
again.

Pipeline parallelism: each micro-batch's ``b x T x d`` activation goes to the next stage and its gradient
comes back, ``2 * b T d c`` bytes per pipeline micro-batch sent by an inner stage. A tied embedding held
by the first and the last stage on two ranks (``parallel/tied_embedding.py``) adds, on those two ranks,
one all-reduce of the copy's FP32 gradient (this rank's shard) per step: :func:`tied_volume`.

Expert parallelism (``parallel.ep``, ``parallel/expert.py``): per MoE layer and micro-batch, forward sends
the routed rows to their experts' ranks and their outputs back (two ``all_to_all_single``), backward the
two gradients the other way (two more), the forward's after a small all-to-all of the ``E`` row counts (int64).
A rank routes its ``n`` tokens to ``k`` experts each, ``n k`` rows of ``d``; with a balanced router a
share ``(ep - 1) / ep`` of them leave the rank (the rest are its own experts'): :func:`ep_volume`. The
dispatched rows are the MLP norm's output (FP32 under FP32 and plain autocast, the compute dtype under
FSDP2's mixed precision: ``r`` bytes), the returned ones the experts' output in the compute dtype ``c``;
backward sends the same sizes. The experts' FP32 gradients are all-reduced once per step over the
``dp / ep`` ranks holding the same experts (``ExpertGradSync``): counted in the data-parallel volume.
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


def dp_collectives(
    kind: str, accum: int = 1, defer: bool = False, pipeline_mb: int = 1, schedule: str = "1f1b"
) -> dict[str, int]:
    """Collectives per optimizer step of ``accum`` micro-batches for one FSDP2 unit (a block; ZeRO-3's
    root gathers only for forwards) or, for DDP and ZeRO-1, for the gradients as a whole (module
    docstring). ``pipeline_mb``: pipeline micro-batches per micro-batch (above 1 on a pipeline stage),
    ``schedule``: ``parallel.pp_schedule``. Keys: ``all_reduce``, ``broadcast``, ``all_gather`` (split
    into ``all_gather_forward`` and ``all_gather_backward``), ``reduce_scatter``."""
    if kind == "none":
        return {}
    if kind == "ddp":
        return {"all_reduce": 1}
    if kind == "zero1":
        return {"all_reduce": 1, "broadcast": 1}
    if kind not in ("zero2", "zero3"):
        raise ValueError(f"unknown data-parallel kind {kind!r}")
    pipeline = pipeline_mb > 1
    reduces = accum if pipeline or not defer else 1
    if kind == "zero2":
        forward, backward = (accum if pipeline else 1), 0
    elif pipeline:
        forward = accum * pipeline_mb
        backward = accum * (1 if schedule == "gpipe" else pipeline_mb)
    else:
        forward = backward = accum
    return {
        "all_gather": forward + backward,
        "all_gather_forward": forward,
        "all_gather_backward": backward,
        "reduce_scatter": reduces,
    }


def dp_volume(
    kind: str,
    p_local: float,
    n: int,
    compute_bytes: int,
    accum: int = 1,
    root: float = 0.0,
    replicas: int = 1,
    accounting: str = "lmforge",
    defer: bool = False,
    pipeline_mb: int = 1,
    schedule: str = "1f1b",
) -> float:
    """Bytes per step and device of data parallelism over ``n`` sharding ranks (``replicas`` copies of
    them; DDP: ``n`` replicas of one), for a device holding ``p_local`` parameters (its TP/PP part).

    ``ddp``: ``all_reduce(g P, n)``; ``zero1``: that plus ``all_gather(4 P, n)`` (lmforge) or
    ``reduce_scatter(g P) + all_gather(c P)`` (zero-paper); FSDP2 (``zero2``, ``zero3``), with the counts
    ``F``, ``B``, ``R`` of :func:`dp_collectives` (forward gathers, backward gathers, reduce-scatters):
    ``F all_gather(c P) + B all_gather(c (P - root)) + R (reduce_scatter(g P) + all_reduce(g P / n,
    replicas))``, the last term hybrid sharding's all-reduce of each shard. ``g``: 4 (lmforge), 2
    (zero-paper: 16-bit gradients reduced in 16 bits, one micro-batch, the paper's counts).
    """
    g = 4 if accounting == "lmforge" else 2
    c = compute_bytes if accounting == "lmforge" else 2
    if kind == "none":
        return 0.0
    if kind == "ddp":
        return all_reduce(g * p_local, n * replicas)
    if kind == "zero1":
        if accounting == "lmforge":
            return all_reduce(g * p_local, n * replicas) + all_gather(4 * p_local, n)
        return reduce_scatter(g * p_local, n) + all_gather(c * p_local, n)
    if accounting == "lmforge":
        counts = dp_collectives(kind, accum, defer, pipeline_mb, schedule)
    else:
        counts = dp_collectives(kind)
        root = 0.0
    forward, backward, reduces = (
        counts["all_gather_forward"],
        counts["all_gather_backward"],
        counts["reduce_scatter"],
    )
    hybrid = all_reduce(g * p_local / n, replicas)
    return (
        forward * all_gather(c * p_local, n)
        + backward * all_gather(c * (p_local - root), n)
        + reduces * (reduce_scatter(g * p_local, n) + hybrid)
    )


VOCAB_PARALLEL_STATS = 4 + 2 * 8  # bytes per token all-reduced by the vocabulary-parallel cross-entropy


def tp_volume(
    tp: int,
    layers: int,
    tokens: int,
    d_model: int,
    vocab_size: int,
    compute_bytes: int,
    recompute: float = 0.0,
    head: bool = True,
    loss: str = "fused",
) -> float:
    """Bytes per device of tensor parallelism for ``tokens`` (= b x T summed over the step's
    micro-batches): ``(8 + 4 r) (t - 1)/t * tokens * d * c`` per block (``r`` the recomputed share of
    forwards) plus, on the rank holding the head, ``(t - 1)/t * 4 tokens d + all_reduce(4 tokens d, t) +
    all_reduce(20 * tokens, t)`` (``loss="fused"``, vocabulary-parallel: the hidden states gathered in
    FP32, their gradient and the statistics all-reduced) or ``2 (t - 1)/t * tokens * V * c``
    (``loss="chunked"``, the logits all-gathered)."""
    if tp == 1:
        return 0.0
    frac = (tp - 1) / tp
    blocks = (8 + 4 * recompute) * frac * tokens * d_model * compute_bytes * layers
    if not head:
        return blocks
    if loss == "chunked":
        return blocks + 2 * frac * tokens * vocab_size * compute_bytes
    hidden = 4 * tokens * d_model
    return (
        blocks
        + all_gather(hidden, tp)
        + all_reduce(hidden, tp)
        + all_reduce(VOCAB_PARALLEL_STATS * tokens, tp)
    )


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
    ep: float = 0.0  # expert parallelism's all-to-all exchanges (ep_volume)

    @property
    def total(self) -> float:
        """``dp + tp + pp + ep``."""
        return self.dp + self.tp + self.pp + self.ep


def ep_volume(
    ep: int,
    moe_layers: int,
    tokens: int,
    top_k: int,
    d_model: int,
    experts: int,
    dispatch_bytes: int,
    c: int,
    forwards: float = 1.0,
) -> float:
    """Bytes one rank sends per optimizer step in expert parallelism's all-to-alls (module docstring):
    ``tokens`` the rank routes in the step (its micro-batches' tokens), ``forwards`` the forwards of each
    MoE layer per micro-batch (1, plus what activation checkpointing recomputes)::

        (ep - 1) / ep * L_moe * (forwards * (n k d (r + c) + 8 E) + n k d (c + r))

    (forward: the counts, rows out in ``r`` bytes, outputs back in ``c``; backward, with the forward's
    splits: the outputs' gradient out in ``c``, the rows' gradient back in ``r``). A balanced router is assumed: an unbalanced
    one sends more from some ranks (at most every row, ``(ep - 1) / ep`` -> 1). 0 at ``ep = 1``."""
    if ep <= 1 or not moe_layers:
        return 0.0
    rows = tokens * top_k * d_model * (dispatch_bytes + c)
    return (ep - 1) / ep * moe_layers * (forwards * (rows + 8 * experts) + rows)
