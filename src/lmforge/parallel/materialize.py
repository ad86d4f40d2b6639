"""The last step of a sharded build: a model built on the meta device and transformed there (tensor
parallelism, FSDP2 sharding, a pipeline stage's cut) gets storage for this rank's part of every parameter
only, and values equal to what one process would give the whole model from the same seed.

Why not initialise the whole model first and shard it afterwards: then every rank holds the whole FP32
model once, and a model whose weights exceed one device cannot be built at all. Why not initialise the
shards with DTensor's random ops: on CPU every rank would draw the same values for its shard (DTensor's
RNG tracker offsets the stream per shard only on CUDA), and on CUDA the values still differ from one
process's, so a layout would start from other parameters than one process does.

What :func:`materialize` does on a rank:

1. ``to_empty(device)`` on the outermost module: every parameter gets uninitialised storage of its local
   shape (a DTensor's local shard; FSDP2's ``_apply`` re-registers its sharded parameters), then the
   model's non-persistent buffers (RoPE tables) are computed.
2. The whole model's initialisation plan (``model/init.py::init_plan``, computed on a meta copy of the
   whole model: names and shapes only) is walked in order after ``torch.manual_seed(seed)``. For each
   step that draws random numbers, the whole parameter is drawn into one temporary tensor on the device
   (so the random stream advances exactly as in one process, also for parameters this rank does not
   hold, such as other pipeline stages'), the rank's part is cut from it
   (``distribute_tensor(..., src_data_rank=None)``: a local slice, no communication) and copied into
   the shard, and the temporary is freed. A parameter the rank holds whole is initialised in place.

Peak memory of the build on a rank: its own shards plus the largest single parameter of the whole model
(the temporary), never the whole model (``tests/test_distributed.py``'s sharded-build tests measure it
on 2 ranks and, with a 1 GB model, on 8). Cost: every rank draws every parameter of the whole model once, in the time one
process takes to initialise it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lmforge.model.init import InitStep

log = logging.getLogger(__name__)
PROGRESS_S = 10.0  # a build that initialises for longer says how far it is, every this many seconds


@dataclass(frozen=True)
class Init:
    """How a meta-built model gets its values: drawn on ``device`` (the run's: one process draws there
    too, so the random stream is the same) by ``plan`` (the *whole* model's initialisation plan) from
    ``seed``; ``seed = None`` leaves the storage uninitialised for a checkpoint to fill. ``storage``: where
    the parameters live when not on ``device`` (host memory under FSDP2's CPU offload: then the GPU only
    ever holds the temporary of one parameter)."""

    device: torch.device
    plan: tuple[InitStep, ...] = ()
    seed: int | None = None
    storage: torch.device | None = None


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` still lives on the meta device (nothing allocated yet)."""
    return any(p.device.type == "meta" for p in module.parameters())


def local_part(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` (the whole parameter's values) that this rank's ``param`` holds: a DTensor's
    local shard under its mesh and placements (cut locally, nothing sent), else ``whole`` itself."""
    if isinstance(param, DTensor):
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
    return whole


@torch.no_grad()
def initialize(params: dict[str, torch.Tensor], plan: Sequence[InitStep], device: torch.device) -> None:
    """Walk ``plan`` (the whole model's, in order) and fill the parameters of ``params`` (this rank's,
    by whole-model name) that it names; every step that draws is drawn in full, held or not. Past
    ``PROGRESS_S`` seconds it logs how many of the plan's elements are done and the time left."""
    total = sum(math.prod(step.shape) for step in plan)
    start = last = time.monotonic()
    done = 0
    for step in plan:
        now = time.monotonic()
        if now - last >= PROGRESS_S and done:
            last = now
            left = (now - start) * (total - done) / done
            log.info(
                "initialising parameters: %.0f%% of %.3gB values, about %.0f s left",
                100 * done / total,
                total / 1e9,
                left,
            )
        done += math.prod(step.shape)
        mine = list({id(params[n]): params[n] for n in step.names if n in params}.values())
        if not mine and not step.draws:
            continue
        if len(mine) == 1 and not isinstance(mine[0], DTensor):
            step.apply(mine[0])  # held whole: in place, no temporary
            continue
        whole = torch.empty(step.shape, dtype=step.dtype, device=device)
        step.apply(whole)
        for param in mine:
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(local_part(param, whole))
        del whole


def materialize(module: nn.Module, model: nn.Module, init: Init) -> None:
    """Allocate this rank's part of every parameter of ``module`` (the outermost, transformed module) on
    ``init.storage`` (default ``init.device``) and initialise it by ``init.plan`` from ``init.seed`` (see
    the module docstring); buffers are computed on ``init.device``. ``model``: the plain network inside
    ``module`` (parameter names as in the whole model; it provides ``reset_buffers`` and, when its
    storage is shared between modules, ``tie_weights``)."""
    module.to_empty(device=init.storage or init.device)
    model.tie_weights()
    model.reset_buffers(init.device)
    if init.seed is None:
        return
    torch.manual_seed(init.seed)
    initialize(dict(model.named_parameters(remove_duplicate=False)), init.plan, init.device)
