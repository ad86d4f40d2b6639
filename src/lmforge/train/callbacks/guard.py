"""The stability guard as a callback: veto bad steps, roll back after repeated ones (logic and rules in
``train/guard.py``)."""

from __future__ import annotations

import torch

from lmforge.config import GuardConfig
from lmforge.train.callbacks.base import Callback
from lmforge.train.guard import Guard, LastGood
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer


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
