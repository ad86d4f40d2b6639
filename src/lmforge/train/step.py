"""One optimizer step, readable in one screen.

The step drives a training module (``train/modules.py::TrainModule``) and never asks what it is. For each
micro-batch, inside the module's micro-batch context (when data-parallel ranks synchronise): forward and
backward of the summed loss divided by the number of targets of the *whole* step (over all data-parallel
ranks), so gradients accumulate to those of one large batch. After each micro-batch the observers hear of
it (``after_micro_batch``: its index, its target tokens, the step's; the gradient noise scale reads the
gradient of the first). After the last one the module completes the gradients (``finish_backward``). Then
bring gradients
to their true scale, measure their norm, ask the step's observers whether to go on (the stability
guard may veto: skip, or roll back), clip (``optim/clip.py``), transform the clipped gradients (gradient
noise, centralization: ``optim/grad_transforms.py``), set the scheduled learning rate and take the
optimizer step through the policy; gradients are cleared either way.

With a loss scaler (``train.precision = "fp16"``) a step whose unscaled gradients hold Inf/NaN while the
loss is finite is an overflow, decided before the observers are asked: the policy's ``step`` skips it and
backs the scale off, the result is ``SKIP`` with ``overflow=True``, and the guard never sees it (it is
not one of its bad steps). A vetoed step tells the policy (``discard``), which leaves the scale as it was.
See ``lmforge/precision.py`` for the whole agreement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch

from lmforge.data.loader import Batch
from lmforge.optim.clip import Clipper, ClipStats
from lmforge.optim.grad_transforms import GradTransforms
from lmforge.parallel.reduce import StepReduce
from lmforge.precision import PrecisionPolicy
from lmforge.train.modules import TrainModule


class Action(Enum):
    """What happens to a step whose gradients are ready."""

    STEP = "step"
    SKIP = "skip"
    ROLLBACK = "rollback"


SEVERITY = {Action.STEP: 0, Action.SKIP: 1, Action.ROLLBACK: 2}


class StepObserver(Protocol):
    """What a step calls back into (the trainer passes its callbacks)."""

    def after_micro_batch(self, index: int, n_targets: int, step_targets: int) -> None: ...

    def after_backward(self) -> None: ...

    def veto(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action: ...


@dataclass
class StepResult:
    loss: torch.Tensor  # mean token loss of the step
    grad_norm: torch.Tensor  # global gradient norm before clipping
    clip: ClipStats | None  # clip ratio and threshold (None: no step taken)
    action: Action  # STEP; SKIP / ROLLBACK: an observer vetoed it (SKIP also: the loss scaler skipped it)
    overflow: bool = False  # the loss scaler skipped the step: Inf/NaN gradients with a finite loss
    loss_scale: float | None = None  # with overflow: the scale the step used (before backing off)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's rate is ``lr`` times its ``lr_mult`` (muP, per-kind and layer-wise multipliers)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def train_step(
    module: TrainModule,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    lr: float,
    clipper: Clipper,
    precision: PrecisionPolicy,
    observers: Sequence[StepObserver] = (),
    reduce: StepReduce | None = None,
    transforms: GradTransforms | None = None,
) -> StepResult:
    """One optimizer step of ``module`` over ``batches`` (the micro-batches) unless an observer vetoes it.

    A vetoed step drops its gradients and leaves the optimizer as it was. ``reduce``: the collectives over
    the process layout (one process: none). ``transforms``: what changes the clipped gradients (none).
    """
    reduce = reduce or StepReduce()
    counts = [b.n_targets for b in batches]
    n_targets = reduce.total_targets(sum(counts), precision.device)
    loss_total = torch.zeros((), dtype=precision.sum_dtype, device=precision.device)
    for i, batch in enumerate(batches):
        with module.micro_batch(i, len(batches)):
            loss_total += module.forward_backward(batch.to(precision.device), n_targets, reduce.dp, precision)
        for obs in observers:  # e.g. the gradient noise scale reads the first micro-batch's gradient
            obs.after_micro_batch(i, counts[i], n_targets)
    module.finish_backward()
    loss_total = reduce.loss(loss_total)
    for obs in observers:
        obs.after_backward()
    precision.unscale_(optimizer)
    groups = [group["params"] for group in optimizer.param_groups]
    grad_norm = clipper.measure(groups)
    if precision.overflowed(optimizer, loss_total):  # the loss scaler's business, not the observers'
        scale = precision.loss_scale
        precision.step(optimizer)  # not taken; backs the scale off
        optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_total, grad_norm, None, Action.SKIP, overflow=True, loss_scale=scale)
    verdicts = [obs.veto(loss_total, grad_norm) for obs in observers]
    action = max(verdicts, key=SEVERITY.__getitem__, default=Action.STEP)
    clip_stats, overflow, scale = None, False, None
    if action is Action.STEP:
        clip_stats = clipper.clip(groups, grad_norm)
        if transforms is not None:
            transforms.apply(groups)
        set_lr(optimizer, lr)
        scale = precision.loss_scale
        if not precision.step(optimizer):  # a scaler skipped it (a non-finite loss no observer vetoed)
            action, clip_stats, overflow = Action.SKIP, None, True
        else:
            scale = None
    else:
        precision.discard(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_total, grad_norm, clip_stats, action, overflow, scale)
