"""``train.micro_batch_size = "auto"``: the largest micro-batch the planner says fits, tokens per step kept.

The optimizer step keeps ``train.tokens_per_step`` (required with ``auto``: it is what the user fixes);
the candidates are the micro-batch sizes that split it evenly, ``tokens_per_step / (seq_len * dp)`` and its
divisors (multiples of the pipeline's micro-batches under ``parallel.pp``; ``plan/micro_batch.py``). The
chosen one is the largest whose :func:`lmforge.plan.estimate.estimate` per-device total stays under the
planner's margin (80% of the device memory) on this run's device: a CUDA GPU's total memory, or on a CPU
the host's RAM shared by the processes of this host. Accumulation makes up the rest of the step.

On a single CUDA device the choice is then probed (:func:`probe`): one forward and backward of a
micro-batch of that size; an out-of-memory error moves to the next smaller candidate. Several processes
trust the planner (an out-of-memory error inside a collective would leave the other ranks waiting).
Everything is logged in one line; the run's ``config.toml`` keeps the resolved number, so a resume on the
same machine continues with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import Estimate, estimate, layout_from_config, workload_from_config
from lmforge.plan.hardware import Hardware, cpu, host_memory_bytes
from lmforge.plan.micro_batch import auto_candidates, largest
from lmforge.precision import native_bf16

log = logging.getLogger(__name__)

GIB = 2**30


def device_hardware(
    device: torch.device, processes_per_host: int, memory_bytes: int | None = None
) -> Hardware:
    """The planner's view of this run's device: a CUDA GPU's total memory, or this host's RAM divided among
    its processes (``memory_bytes`` overrides either). Only memory matters for fitting (peak FLOP/s 1)."""
    if memory_bytes is None:
        if device.type == "cuda":
            memory_bytes = torch.cuda.get_device_properties(device).total_memory
        else:
            memory_bytes = host_memory_bytes() // processes_per_host
    if device.type == "cuda":
        flops = dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8"), 1.0)
        return Hardware(f"cuda ({torch.cuda.get_device_name(device)})", memory_bytes, flops)
    return cpu(1.0, memory_bytes)


def planned_precision(requested: str, device: torch.device) -> str:
    """``train.precision`` as the run will resolve it (``auto``: bf16 where native, else fp32), unlogged."""
    if requested == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return requested


def resolve_micro_batch(
    cfg: Config, device: torch.device, processes_per_host: int = 1, memory_bytes: int | None = None
) -> tuple[Config, list[int], float]:
    """``cfg`` with ``train.micro_batch_size`` resolved, the smaller candidates left (for a probe) and the
    planner's optimizer-state bytes per device (the probe's step creates none).

    A number is returned as it is (no candidates). ``auto`` needs ``train.tokens_per_step``; the largest
    candidate whose estimate fits is chosen (the smallest when none does, with a warning: the run may
    still fit, the estimate carries a margin)."""
    if cfg.train.micro_batch_size != "auto":
        return cfg, [], 0.0
    sizes = auto_candidates(cfg)
    p = cfg.parallel
    hw = device_hardware(device, processes_per_host, memory_bytes)
    workload = workload_from_config(
        cfg,
        planned_precision(cfg.train.precision, device),
        attention_kind(device.type, cfg.train.attention, cfg.model.doc_mask),
    )
    base = layout_from_config(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": 1})})
    )
    seen: dict[int, Estimate] = {}

    def fits(size: int) -> bool:
        seen[size] = estimate(workload, replace(base, micro_batch=size), hw)
        return seen[size].fits

    chosen = largest(sizes, fits)
    if chosen is None:
        chosen = sizes[-1]
        log.warning(
            "train.micro_batch_size: auto -> %d, the smallest candidate; the planner estimates %.2f GiB per "
            "device, over %.0f%% of %.2f GiB (lower train.tokens_per_step's share per rank, shard more or "
            "checkpoint activations)",
            chosen, seen[chosen].total / GIB, 100 * seen[chosen].margin, hw.memory_bytes / GIB,
        )  # fmt: skip
    else:
        bigger = [s for s in sizes if s > chosen]
        over = f"; {bigger[-1]} would need {seen[bigger[-1]].total / GIB:.2f} GiB" if bigger else ""
        log.info(
            "train.micro_batch_size: auto -> %d (planner: %.2f GiB of %.2f GiB per device, under the %.0f%% "
            "margin%s); %d micro-batches per step and data-parallel rank",
            chosen, seen[chosen].total / GIB, hw.memory_bytes / GIB, 100 * seen[chosen].margin, over,
            cfg.train.tokens_per_step // (chosen * cfg.data.seq_len * p.dp_replicate * p.dp_shard),
        )  # fmt: skip
    train = cfg.train.model_copy(update={"micro_batch_size": chosen})
    smaller = [s for s in sizes if s < chosen]
    return cfg.model_copy(update={"train": train}), smaller, seen[chosen].states.optim


def probe(
    objective: nn.Module,
    cfg: Config,
    smaller: list[int],
    vocab_size: int,
    autocast: Callable,
    optimizer_bytes: float,
) -> Config:
    """On one CUDA device: a forward and backward of one micro-batch of ``cfg``'s size; when it runs out of
    memory, or its peak plus the optimizer states still to come (``optimizer_bytes``, the planner's) exceeds
    the device, the next of ``smaller`` (largest first). Returns ``cfg`` with the size that ran."""
    sizes = [cfg.train.micro_batch_size, *smaller]
    device = next(objective.parameters()).device
    total = torch.cuda.get_device_properties(device).total_memory
    for size in sizes:
        torch.cuda.reset_peak_memory_stats(device)
        tokens = torch.randint(0, vocab_size, (size, cfg.data.seq_len), device=device)
        loss = None
        try:
            with autocast():
                loss, _ = objective(tokens, tokens, None)
            loss.backward()
            fits = torch.cuda.max_memory_allocated(device) + optimizer_bytes <= total
        except torch.OutOfMemoryError:
            fits = False
        del tokens, loss  # the graph of a failed backward too
        objective.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if not fits:
            log.warning("train.micro_batch_size: auto: %d sequences do not fit in the probe", size)
            continue
        if size != cfg.train.micro_batch_size:
            log.info("train.micro_batch_size: auto -> %d after the probe", size)
        return cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": size})})
    raise ConfigError(
        f"train.micro_batch_size: auto: even {sizes[-1]} sequence(s) of {cfg.data.seq_len} tokens ran out of "
        "memory; shorten data.seq_len, checkpoint activations or shard the model"
    )
