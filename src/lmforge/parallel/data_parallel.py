"""Data parallelism with PyTorch's own machinery, one choice per ``parallel.*`` layout.

=================  ==========================================================================  =========
layout             machinery                                                                   ZeRO stage
=================  ==========================================================================  =========
``dp_replicate``   ``DistributedDataParallel``: full replicas, gradients all-reduced           (DDP)
``dp_shard, z=1``  DDP + ``ZeroRedundancyOptimizer``: optimizer states sharded                 1
``dp_shard, z=2``  FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients and optimizer  2
                   states sharded, parameters kept gathered from forward to backward
``dp_shard, z=3``  FSDP2 ``fully_shard``: parameters, gradients and states sharded             3
both               hybrid sharding (FSDP2 on the 2-D mesh ``(dp_replicate, dp_shard)``: shard
                   inside a group, replicate across groups), or DDP over both with ZeRO-1
=================  ==========================================================================  =========

FSDP2 is applied to every block and then to the training objective (the root: embedding, final norm and
head), so each block's parameters are gathered just before it runs. Under ``bf16`` FSDP2 keeps FP32
sharded parameters and computes with BF16 copies, reducing gradients in FP32 (``MixedPrecisionPolicy``).
Under ``fp8`` the same policy applies (BF16 is its compute dtype), except for the float8 layers' weights
under the tensorwise recipe: their FP32 shards are wrapped by the FP8 conversion
(``lmforge/precision.py::convert_fp8``, torchao's ``enable_fsdp_float8_all_gather``), whose
``fsdp_pre_all_gather`` casts each shard to float8 with the scale of the whole weight, so FSDP2 gathers
one byte per value (as ``uint8``, together with the block's BF16 norm weights) and rebuilds a float8
weight after the gather; the scales are precomputed after each optimizer step
(``register_fp8_scale_precompute``).
``parallel.offload`` keeps the sharded parameters, gradients and optimizer states in host memory
(``CPUOffloadPolicy``; the optimizer steps on the CPU), the ZeRO-Offload idea.

Gradients of DDP and FSDP2 are averaged over the data-parallel ranks; the training step multiplies each
rank's loss by ``dp`` so that the averaged gradient is that of the whole step's token sum divided by the
step's target count (``lmforge/train/step.py``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from lmforge.parallel.comm_hooks import CommHook
from lmforge.parallel.expert import ExpertGradSync
from lmforge.parallel.layout import Layout


def fsdp_mesh(layout: Layout):
    """The mesh FSDP2 shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for hybrid sharding."""
    if layout.degrees["dp_replicate"] > 1:
        return layout.submesh("dp_replicate", "dp_shard")
    return layout.submesh("dp_shard")


def apply_fsdp(
    objective: nn.Module,
    blocks: list[nn.Module],
    layout: Layout,
    compute_dtype: torch.dtype,
    head: nn.Module | None = None,
    ignored: set[nn.Parameter] | frozenset = frozenset(),
) -> nn.Module:
    """``fully_shard`` each of ``blocks`` and an untied output ``head``, then ``objective`` (the root);
    returns ``objective``. The head is a unit of its own because a pipeline's last stage calls it from
    the loss, outside the stage's forward, where it must still gather its weight. ``ignored``: parameters
    FSDP2 leaves as they are (expert-parallel experts)."""
    kw: dict = {"mesh": fsdp_mesh(layout), "reshard_after_forward": layout.zero == 3}
    if ignored:
        kw["ignored_params"] = set(ignored)
    if compute_dtype not in (torch.float32, torch.float64):  # autocast: gathered low, reduced in FP32
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if layout.offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for block in [*blocks, *([head] if head is not None else [])]:
        fully_shard(block, **kw)
    # The root (embedding, final norm, a tied head) is needed again as soon as backward starts: it stays
    # gathered from forward to backward, as FSDP2 does by default for a root, instead of a second gather.
    fully_shard(objective, **{**kw, "reshard_after_forward": False})
    return objective


def apply_ddp(
    objective: nn.Module,
    layout: Layout,
    device: torch.device,
    ignored: set[nn.Parameter] | frozenset = frozenset(),
    comm: CommHook | None = None,
) -> nn.Module:
    """``DistributedDataParallel`` over all data-parallel ranks (also under ZeRO-1); ``ignored``: parameters
    DDP neither broadcasts nor reduces (expert-parallel experts); ``comm``: the gradient compression of
    ``parallel.ddp_comm_hook`` (``parallel/comm_hooks.py``), registered on it.

    ``init_sync=False``: DDP does not broadcast rank 0's parameters and buffers when it wraps the model.
    Every rank already holds the same values (the build draws them from ``train.seed`` on every rank,
    ``parallel/materialize.py``; a resume loads one checkpoint on every rank; the layout tests check a
    DDP run against one process), and the broadcast's flattened copy of every parameter was freed by
    gloo's thread at no fixed moment: a third of the builds measured it still alive beside DDP's
    gradient buckets (12 instead of 8 bytes per parameter at the build's peak)."""
    ids = [device.index] if device.type == "cuda" else None
    if ignored:
        names = [n for n, p in objective.named_parameters() if p in ignored]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(objective, names)
    ddp = DistributedDataParallel(
        objective, device_ids=ids, process_group=layout.group("dp"), init_sync=False
    )
    if comm is not None:
        comm.register(ddp, [p for p in objective.parameters() if p.requires_grad and p not in ignored])
    return ddp


class GradientSync:
    """When the data-parallel ranks communicate during one optimizer step of several micro-batches: the
    context of each micro-batch (``train/modules.py`` enters it around every forward and backward).

    * DDP (also under ZeRO-1): gradients are all-reduced in the last micro-batch only (``no_sync`` before
      it), so a step pays one all-reduce of the gradients whatever its accumulation.
    * FSDP2, ZeRO-2 (``reshard_after_forward=False``): the parameters gathered for the first forward stay
      gathered through every micro-batch of the step (``set_reshard_after_backward(False)`` until the last
      backward): one all-gather per step instead of one per micro-batch.
    * FSDP2, ZeRO-3: parameters are gathered for each forward and again for each backward, as full
      sharding means.
    * FSDP2 with ``parallel.defer_grad_sync``: gradients stay unsharded and accumulate locally in FP32
      until the last micro-batch, which reduce-scatters them once (``set_requires_gradient_sync``): one
      reduce-scatter per step instead of one per micro-batch, for the memory of the unsharded gradients.
      Without it each micro-batch reduce-scatters and accumulates into the sharded gradients.

    ``tests/distributed/accumulation_worker.py`` counts the collectives of each case.


    Expert-parallel experts (outside DDP and FSDP2) are reduced once, after the step's last backward
    (:meth:`finish`, ``parallel/expert.py::ExpertGradSync``).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        layout: Layout | None = None,
        defer: bool = False,
        experts: ExpertGradSync | None = None,
    ):
        self.module, self.defer, self.experts = module, defer, experts
        self.zero = layout.zero if layout is not None else 3

    def finish(self) -> None:
        """After the step's last backward: what is not reduced during backward (expert-parallel experts)."""
        if self.experts is not None:
            self.experts.finish()

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        """The context of micro-batch ``index`` (from 0) of a step of ``count``."""
        last = index == count - 1
        if isinstance(self.module, DistributedDataParallel):
            return contextlib.nullcontext() if last else self.module.no_sync()
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(last or not self.defer, recurse=True)
            if self.zero == 2:
                self.module.set_reshard_after_backward(last, recurse=True)
        return contextlib.nullcontext()
