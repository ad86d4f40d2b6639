"""The search for layouts that fit: every layout lmforge can run on ``gpus`` devices, estimated
(``plan/estimate.py``) and ranked by estimated throughput; and, when none fits, the fewest devices on
which one does. Pure: nothing is allocated."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from lmforge.errors import ConfigError
from lmforge.parallel.pipeline import check_pipeline, pipeline_settings
from lmforge.parallel.tensor import check_tensor_parallel
from lmforge.plan.estimate import (
    DEFAULT_MARGIN,
    DEFAULT_MFU,
    GPUS_PER_NODE,
    POLICIES,
    Estimate,
    Layout,
    Workload,
    estimate,
)
from lmforge.plan.hardware import Hardware


def divisors(n: int) -> list[int]:
    """``[d for d in 1..n if n % d == 0]``."""
    return [d for d in range(1, n + 1) if n % d == 0]


def runnable(workload: Workload, layout: Layout) -> bool:
    """Whether lmforge runs ``layout`` for this model: its own checks (``parallel/tensor.py``'s
    ``check_tensor_parallel``: heads, MLP width, vocabulary and sequence divisible by ``tp``;
    ``parallel/pipeline.py``'s ``check_pipeline``: stages, schedule, micro-batches) and
    ``parallel/layout.py``'s rule that DDP and ZeRO-1 take neither TP nor PP."""
    if layout.kind in ("ddp", "zero1") and (layout.tp > 1 or layout.pp > 1):
        return False
    cfg = workload.model
    try:
        check_tensor_parallel(cfg, workload.vocab_size, workload.seq_len, layout.tp)
        if layout.pp > 1:
            m, v = pipeline_settings(
                layout.pp, layout.pp_schedule, layout.pp_microbatches, layout.pp_stages_per_rank
            )
            check_pipeline(cfg.n_layers, layout.pp, layout.pp_schedule, m, layout.micro_batch, v)
    except ConfigError:
        return False
    return True


def candidate_layouts(
    workload: Workload, gpus: int, micro_batches: tuple[int, ...] = (1, 2, 4, 8)
) -> list[Layout]:
    """Every layout of ``gpus`` devices lmforge can run (:func:`runnable`): ``tp`` up to a node (8);
    ``pp`` up to the layer count; the data-parallel rest as DDP, ZeRO-1, -2, -3, or hybrid ZeRO-3
    (sharded inside a node, replicated across); each checkpointing policy of :data:`POLICIES` and
    micro-batch size; a pipeline (1F1B) splits each micro-batch into one pipeline micro-batch per
    sequence (at least ``pp``)."""
    cfg = workload.model
    out = []
    for tp in divisors(gpus):
        if tp > GPUS_PER_NODE:
            continue
        for pp in divisors(gpus // tp):
            if pp > cfg.n_layers:
                continue
            dp = gpus // tp // pp
            dps: list[tuple[int, int, int]] = []  # (dp_replicate, dp_shard, zero)
            if dp == 1:
                dps.append((1, 1, 3))
            else:
                if tp == 1 and pp == 1:
                    dps += [(dp, 1, 3), (1, dp, 1)]
                dps += [(1, dp, 2), (1, dp, 3)]
                inner = math.gcd(dp, max(1, GPUS_PER_NODE // tp))
                if 1 < inner < dp:
                    dps.append((dp // inner, inner, 3))
            for (rep, shard, zero), policy, mb in itertools.product(dps, POLICIES, micro_batches):
                if pp > 1 and mb < pp:
                    continue  # fewer sequences than stages: the bubble would exceed half the step
                layout = Layout(rep, shard, tp, pp, zero, mb, policy, "1f1b", mb if pp > 1 else 0)
                if runnable(workload, layout):
                    out.append(layout)
    return out


def search(
    workload: Workload,
    gpus: int,
    hw: Hardware,
    accounting: str = "lmforge",
    margin: float = DEFAULT_MARGIN,
    mfu: float = DEFAULT_MFU,
    top: int = 10,
) -> list[Estimate]:
    """The layouts of :func:`candidate_layouts` that fit, fastest first (estimated tokens/s; ties: less
    memory); at most ``top``. The step's tokens stay those of ``workload`` (default: ``gpus`` sequences);
    layouts whose micro-batches do not divide them are skipped."""
    if workload.tokens_per_step is None:
        workload = replace(workload, tokens_per_step=gpus * workload.seq_len)
    found = []
    for layout in candidate_layouts(workload, gpus):
        try:
            e = estimate(workload, layout, hw, accounting, margin, mfu)
        except ValueError:
            continue
        if e.fits:
            found.append(e)
    found.sort(key=lambda e: (-e.tokens_per_s, e.total))
    return found[:top]


def fewest_devices(
    workload: Workload,
    gpus: int,
    hw: Hardware,
    accounting: str = "lmforge",
    margin: float = DEFAULT_MARGIN,
    mfu: float = DEFAULT_MFU,
    limit: int = 4096,
) -> tuple[int, Estimate] | None:
    """When nothing fits on ``gpus`` devices: the smallest ``gpus * 2^k`` (up to ``limit``) on which a
    layout fits, with its fastest layout; the step's tokens grow with the devices (one sequence each,
    unless ``workload`` fixes them). None when none up to ``limit`` does."""
    n = gpus * 2
    while n <= limit:
        found = search(workload, n, hw, accounting, margin, mfu, top=1)
        if found:
            return n, found[0]
        n *= 2
    return None
