"""The few collectives a training step needs, so that every process sees the figures of the whole step.

* the number of target tokens of the step, summed over the data-parallel ranks (the loss of every
  micro-batch is divided by it, so the gradient is the same as one process computing the whole batch);
* the step's loss, summed over the data-parallel ranks (each holds its share ``sum_r loss_r / N``) and
  over the pipeline stages (only the last one computes it), so the guard's NaN and spike checks and the
  metrics agree on every rank.

When the gradients themselves are reduced during a step is the training module's micro-batch context
(``parallel/data_parallel.py::GradientSync``).

The gradient norm is reduced by the clipper (``lmforge/optim/clip.py``). One process: no collective.

:func:`sum_over` sums a host tensor of figures (RL's metric sums) over a group whatever its backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmforge.parallel.layout import SINGLE, Layout


class StepReduce:
    """The reductions of one training step over the process layout."""

    def __init__(self, layout: Layout = SINGLE):
        self.layout = layout
        self.dp = layout.dp

    def total_targets(self, n: int, device: torch.device) -> int:
        """``N = sum_r n_r`` over the data-parallel ranks."""
        if self.dp == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=self.layout.group("dp"))
        return int(t.item())

    def loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's mean token loss from each rank's share (sum over data-parallel ranks and stages)."""
        if not self.layout.distributed:
            return local
        total = local.detach().to(torch.promote_types(local.dtype, torch.float32), copy=True)
        if self.dp > 1:
            dist.all_reduce(total, group=self.layout.group("dp"))
        if self.layout.degrees["pp"] > 1:
            dist.all_reduce(total, group=self.layout.group("pp"))
        return total


def sum_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` summed over ``group``'s ranks, a new tensor on ``t``'s device. NCCL has no path for host tensors
    (a process group started with ``"nccl"`` alone, as ``parallel/layout.py`` starts it on CUDA), so a host
    tensor crosses through this process's CUDA device there; gloo sums it where it is."""
    through_device = t.device.type == "cpu" and dist.get_backend(group) == "nccl"
    out = t.cuda() if through_device else t.clone()
    dist.all_reduce(out, group=group)
    return out.to(t.device)
