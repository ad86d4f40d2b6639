"""The model transformations of a run, applied from outside the model in one fixed order.

    convert -> tensor parallel -> activation checkpointing -> compile -> data-parallel sharding

Each stage is a function ``(module, ctx) -> module`` and :data:`STAGES` lists them in that order; this is
the only place the order is written. The order is forced by what each stage needs to see:

1. ``convert`` swaps module types (FP8 linear layers, lmforge/precision): every later stage must see the
   final modules, and tensor parallelism must shard the converted weights.
2. ``tensor_parallel`` (``parallelize_module``) shards the weights of each block across the TP mesh.
3. ``activation_checkpointing`` wraps whole blocks, which must already be sharded.
4. ``compile`` traces the blocks as they will run: converted, sharded and checkpointed.
5. ``data_parallel`` (``fully_shard`` / DDP) comes last: it wraps the compiled modules and owns the
   parameters' storage from then on.

``convert`` swaps the linear layers for torchao's float8 ones with ``train.precision = "fp8"`` (else
it returns the module unchanged). Pipeline parallelism cuts the model into stages (``lmforge/parallel/pipeline.py``)
before any of them; the stages then run on each stage's objective.

Compilation: a single process compiles the whole training objective
(:class:`~lmforge.model.loss.NextTokenLoss`: blocks, output head and chunked loss as one graph); it never
replaces a method of the model. Measured on 2 CPU cores (default Llama 4 x 256, vocab 4096, batch 8 x 256,
BF16): eager 3,540 tokens/s, every block compiled separately 3,350, the whole objective compiled 4,070.
Several processes compile each block in place instead (``Module.compile``), so that the hooks of
FSDP2, DDP and tensor parallelism stay at block boundaries, outside the compiled graphs.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.config import TrainConfig
from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp
from lmforge.parallel.layout import SINGLE, Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApplyContext:
    """What the stages read: the run's training settings, device, process layout and compute dtype."""

    train: TrainConfig
    device: torch.device
    layout: Layout = SINGLE
    compute_dtype: torch.dtype = torch.float32


def model_of(module: nn.Module) -> nn.Module:
    """The network inside a training objective (a pipeline stage is the network itself)."""
    return getattr(module, "model", module)


def can_compile(enabled: bool, device: torch.device) -> bool:
    """``train.compile``, unless on CPU without a C++ compiler (then a warning, and eager)."""
    if not enabled:
        return False
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        log.warning("train.compile: no C++ compiler found, running eager (install g++ to compile on CPU)")
        return False
    return True


def convert(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Module conversions: with ``train.precision = "fp8"``, torchao float8 training of the linear layers
    (``train.fp8_recipe``; ``lmforge/precision.py::convert_fp8``); else unchanged."""
    if ctx.train.precision == "fp8":
        from lmforge.precision import convert_fp8

        convert_fp8(model_of(module), ctx.train.fp8_recipe, ctx.device)
    return module


def tensor_parallel(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Tensor parallelism over the ``tp`` mesh dimension (``lmforge/parallel/tensor.py``); else unchanged."""
    if ctx.layout.degrees["tp"] == 1:
        return module
    from lmforge.parallel.tensor import apply_tensor_parallel

    apply_tensor_parallel(model_of(module), ctx.layout.submesh("tp"))
    return module


def activation_checkpointing(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Recompute block activations in backward. Not configured yet: unchanged."""
    return module


COMPILE_OPTIONS: dict = {}  # torch.compile keyword arguments of the training objective (defaults measured best)


def compile_like_training(fn: Callable) -> Callable:
    """``torch.compile(fn, **COMPILE_OPTIONS)``: how the training objective is compiled (benchmarks compile
    their baselines through this too, so both sides get the same settings)."""
    return torch.compile(fn, **COMPILE_OPTIONS)


def compile_module(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """``torch.compile`` when ``train.compile`` (and the platform can): the whole objective in one process,
    each block in place in several."""
    if not can_compile(ctx.train.compile, ctx.device):
        return module
    if ctx.layout.distributed:
        for block in model_of(module).blocks.values():
            block.compile(**COMPILE_OPTIONS)
        return module
    return compile_like_training(module)


def data_parallel(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """FSDP2 (blocks, then the objective) or DDP over the data-parallel ranks
    (``lmforge/parallel/data_parallel.py``); one process: unchanged."""
    kind = ctx.layout.kind
    if kind == "fsdp":
        model = model_of(module)
        head = model.lm_head if model.lm_head is not None and not model.cfg.tie_embeddings else None
        return apply_fsdp(module, list(model.blocks.values()), ctx.layout, ctx.compute_dtype, head)
    if kind in ("ddp", "zero1"):
        return apply_ddp(module, ctx.layout, ctx.device)
    return module


STAGES: tuple[tuple[str, Callable[[nn.Module, ApplyContext], nn.Module]], ...] = (
    ("convert", convert),
    ("tensor_parallel", tensor_parallel),
    ("activation_checkpointing", activation_checkpointing),
    ("compile", compile_module),
    ("data_parallel", data_parallel),
)


def apply(module: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Every stage of :data:`STAGES`, in order; returns what the training step calls."""
    for _, stage in STAGES:
        module = stage(module, ctx)
    return module
