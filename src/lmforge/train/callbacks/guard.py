"""The stability guard: skip steps with a non-finite or spiking loss, roll back after repeated ones.

Before each optimizer step the step hands (through the :class:`StabilityGuard` callback) the guard
the step's loss and pre-clip gradient norm (:meth:`Guard.check`); both come to the host in one
transfer, the only device sync the guard adds per step (the norm is already a single fused reduction
over all gradients, so one NaN or Inf anywhere shows in it). The verdict is one of:

* ``STEP``: finite and no spike; the loss joins the window of recent accepted losses.
* ``SKIP``: the loss or norm is NaN/Inf (``skip_nonfinite``), or the loss is a spike (``skip_spike``):
  ``loss > mean(W) + spike_sigmas * std(W)`` where ``W`` holds the last ``spike_window`` accepted
  losses, ``std`` is the population standard deviation ``sqrt(mean((w - mean(W))^2))``, and detection
  starts once ``W`` holds ``spike_min_history`` losses. The gradients are dropped: no optimizer step, the
  optimizer state and the step counter (hence the learning-rate schedule) stay as they were; the batch
  is consumed, so the next attempt sees new data.
* ``ROLLBACK``: the ``max_bad_steps``-th skip in a row. The callback restores the last good state (model,
  optimizer, schedule position, progress counters, clipping statistics and the guard's loss window) from
  :class:`LastGood`, and calls :meth:`Guard.rollback`, which multiplies the learning rate by
  ``rollback_lr_factor`` and reports the data skipped: the loader is *not* rewound, so the batches read
  since the snapshot, the bad ones among them, are not replayed (as PaLM did: restart before the spike
  and skip the data around it). After ``max_rollbacks`` rollbacks the next one stops the run with
  :class:`TrainingDiverged`.

Loss-scale overflows (``train.precision = "fp16"``): a step whose gradients hold Inf/NaN while its loss
is finite is decided by the loss scaler before the guard is asked (``train/step.py``): the scaler skips
it and backs its scale off, and the guard is never asked about it, so it is neither a ``skip_nonfinite``
nor one of the ``max_bad_steps`` in a row (the run of bad steps is neither extended nor reset by it).
The guard only accounts for it (:meth:`Guard.overflow`): one ``loss_scale_overflow`` event with the scale
before and after, counted once in ``skipped`` (every skipped attempt, whoever skipped it) and in
``overflows``. A non-finite *loss* stays the guard's (``skip_nonfinite``; the scale is left as it was).
So ``skipped`` always equals the number of ``skip_nonfinite``, ``skip_spike`` and ``loss_scale_overflow``
lines.

Every event is a ``metrics.jsonl`` line with the step it concerns (for a skip: the number the step
would have had) and an ``event`` name, and a logged warning. The guard's window and counters are in
:meth:`Guard.state_dict`, saved in checkpoints, so a resumed run takes the same decisions.

In a multi-process run the loss and norm handed to the guard must already be reduced over ranks so that
every rank decides the same.

The rules (:class:`Guard`, :class:`LastGood`) are plain objects; :class:`StabilityGuard` is the callback
that asks them at each step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from lmforge.config import GuardConfig
from lmforge.errors import UserError
from lmforge.train.callbacks import Callback
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


class TrainingDiverged(UserError):
    """The run kept failing after ``guard.max_rollbacks`` rollbacks."""


def spike_limit(losses: list[float], sigmas: float) -> float:
    """``mean + sigmas * std`` of ``losses`` (population standard deviation)."""
    mean = math.fsum(losses) / len(losses)
    var = math.fsum((x - mean) ** 2 for x in losses) / len(losses)
    return mean + sigmas * math.sqrt(var)


def cpu_copy(tree: Any) -> Any:
    """A deep copy of a state tree with every tensor cloned to CPU memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return type(tree)((k, cpu_copy(v)) for k, v in tree.items())
    if isinstance(tree, list | tuple):
        return type(tree)(cpu_copy(v) for v in tree)
    return tree


class LastGood:
    """The state at the last checkpoint, held in host memory for rollbacks.

    In memory rather than re-read from disk: it exists from step 0 (before the first checkpoint), it
    does not depend on checkpoint pruning or on a checkpoint still being written, and restoring costs
    no file read. The price is one host copy of the model and optimizer state (about three times the
    parameter bytes with AdamW) taken at each checkpoint.
    """

    def __init__(self) -> None:
        self._state: dict | None = None

    def save(self, state: dict) -> None:
        self._state = cpu_copy(state)

    def restore(self) -> dict:
        """A fresh copy (``Optimizer.load_state_dict`` keeps the tensors it is given, so never share)."""
        if self._state is None:
            raise RuntimeError("no good state saved")
        return cpu_copy(self._state)


class Guard:
    """Decides, step by step, whether to step, skip or roll back; ``emit`` receives each event record."""

    def __init__(self, cfg: GuardConfig, emit: Callable[[dict], None] | None = None):
        self.cfg = cfg
        self.emit = emit or (lambda record: None)
        self.losses: list[float] = []  # recent accepted losses, oldest first
        self.bad = 0  # consecutive skipped steps
        self.skipped = 0  # skipped steps in the whole run (the guard's and the loss scaler's)
        self.overflows = 0  # of which loss-scale overflows (skipped by the scaler, not the guard)
        self.rollbacks = 0
        self.lr_scale = 1.0  # product of the rollback learning-rate factors

    def spike_limit(self) -> float | None:
        """The loss above which a step is a spike, or None while detection is off or warming up."""
        if not self.cfg.spike_sigmas or len(self.losses) < self.cfg.spike_min_history:
            return None
        return spike_limit(self.losses, self.cfg.spike_sigmas)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        """The verdict for the attempt at ``step`` with this loss and pre-clip gradient norm."""
        if not self.cfg.enabled:
            return Action.STEP
        pair = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().to(loss.device)])
        loss_f, norm_f = pair.tolist()  # the one host sync
        if not (math.isfinite(loss_f) and math.isfinite(norm_f)):
            return self._bad(step, "skip_nonfinite", loss=loss_f, grad_norm=norm_f)
        limit = self.spike_limit()
        if limit is not None and loss_f > limit:
            return self._bad(step, "skip_spike", loss=loss_f, limit=limit, grad_norm=norm_f)
        self.bad = 0
        self.losses.append(loss_f)
        del self.losses[: -self.cfg.spike_window]
        return Action.STEP

    def _bad(self, step: int, event: str, **fields: float) -> Action:
        self.bad += 1
        self.skipped += 1
        self._event(step, event, **fields, consecutive=self.bad)
        return Action.ROLLBACK if self.bad >= self.cfg.max_bad_steps else Action.SKIP

    def overflow(self, step: int, loss: float, loss_scale: float | None, new_scale: float | None) -> None:
        """Account for the loss scaler's skip of the attempt at ``step`` (Inf/NaN gradients, finite loss):
        counted once, as a skipped step and an overflow; not a bad step (no rollback comes of it)."""
        self.skipped += 1
        self.overflows += 1
        fields: dict[str, Any] = {"loss": loss, "overflows": self.overflows}
        if loss_scale is not None:
            fields["loss_scale"] = loss_scale
        if new_scale is not None:
            fields["new_loss_scale"] = new_scale
        self._event(step, "loss_scale_overflow", **fields)

    def rollback(self, step: int, saved: dict, to_step: int, data_from: int, data_to: int) -> None:
        """Account for a rollback at ``step`` to the state of ``to_step`` (``saved``: the guard's state
        then); the loader goes on from sequence ``data_to``, so ``[data_from, data_to)`` is skipped."""
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise TrainingDiverged(
                f"guard.max_rollbacks: {self.bad} bad steps in a row at step {step} after "
                f"{self.rollbacks} rollbacks; lower optim.lr, or raise guard.max_rollbacks"
            )
        self.rollbacks += 1
        self.losses, self.bad = list(saved["losses"]), 0
        self._event(step, "rollback", to_step=to_step, rollbacks=self.rollbacks)
        if self.cfg.rollback_lr_factor != 1.0:
            before, self.lr_scale = self.lr_scale, self.lr_scale * self.cfg.rollback_lr_factor
            self._event(step, "lr_change", lr_scale=self.lr_scale, previous_lr_scale=before)
        self._event(
            step, "data_skip", from_sequence=data_from, to_sequence=data_to, sequences=data_to - data_from
        )

    def _event(self, step: int, event: str, **fields: Any) -> None:
        record = {"step": step, "event": event, **fields}
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        log.warning("step %d: %s %s", step, event, text)
        self.emit(record)

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "bad": self.bad,
            "skipped": self.skipped,
            "overflows": self.overflows,
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        self.losses = list(state["losses"])
        self.bad, self.skipped = state["bad"], state["skipped"]
        self.overflows = state.get("overflows", 0)  # absent from checkpoints before loss scaling
        self.rollbacks, self.lr_scale = state["rollbacks"], state["lr_scale"]


class GuardObserver:
    """Asks ``guard`` about the attempt at ``step``: the step observer of a standalone
    :func:`~lmforge.train.step.train_step` (a trainer uses the ``StabilityGuard`` callback instead)."""

    def __init__(self, guard: Guard, step: int):
        self.guard, self.step = guard, step

    def after_micro_batch(self, index: int, n_targets: int, step_targets: int) -> None:
        return None

    def after_backward(self) -> None:
        return None

    def veto(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        return self.guard.check(self.step, loss, grad_norm)


class StabilityGuard(Callback):
    """Skips steps with a non-finite or spiking loss; on ``guard.max_bad_steps`` in a row, restores the
    state of the last checkpoint (held in host memory) and reads on past the data since then. Steps the
    loss scaler skipped (``result.overflow``) are only counted and logged (``loss_scale_overflow``)."""

    state_key = "guard"

    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.guard = Guard(cfg)
        self.last_good = LastGood()

    def on_train_start(self, trainer: Trainer) -> None:
        self.guard.emit = trainer.log
        trainer.lr_scale = self.guard.lr_scale
        if self.cfg.enabled:
            self.last_good.save(trainer.state_dict())

    def veto(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        return self.guard.check(trainer.progress.step + 1, loss, grad_norm)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if result.overflow:  # the loss scaler skipped it: counted here, never a bad step of the guard's
            scale = trainer.run.precision.loss_scale
            self.guard.overflow(trainer.progress.step + 1, float(result.loss), result.loss_scale, scale)
            return
        if result.action is not Action.ROLLBACK:
            return
        good = self.last_good.restore()
        self.guard.rollback(
            trainer.progress.step + 1,
            good[self.state_key],
            good["progress"]["step"],
            good["loader"]["position"],
            trainer.run.loader.position,
        )
        trainer.restore(good)
        trainer.lr_scale = self.guard.lr_scale

    def on_checkpoint(self, trainer: Trainer, state: dict) -> None:
        if self.cfg.enabled:
            self.last_good.save(state)

    def on_train_end(self, trainer: Trainer) -> None:
        trainer.summary["skipped_steps"] = self.guard.skipped
        if trainer.run.precision.scaler is not None:
            trainer.summary["loss_scale_overflows"] = self.guard.overflows
            trainer.summary["loss_scale"] = trainer.run.precision.loss_scale
        trainer.summary["rollbacks"] = self.guard.rollbacks

    def state_dict(self) -> dict:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.guard.load_state_dict(state)
