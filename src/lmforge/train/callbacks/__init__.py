"""Everything that happens during a run besides the step itself is a :class:`Callback`: the trainer
sequences, callbacks do everything else. This module holds the contract; one module per job beside it.

Hooks, in the order a run meets them (every one a no-op by default):

* ``on_train_start(trainer)``: after the state is built or restored, before the first step;
* ``on_batches(trainer, batches) -> batches``: the micro-batches about to be trained on;
* ``after_micro_batch(trainer, index, n_targets, step_targets)``: micro-batch ``index`` (``n_targets``
  target tokens on this rank; the step has ``step_targets`` over all data-parallel ranks) went backward;
* ``after_backward(trainer)``: gradients are accumulated, nothing measured yet;
* ``veto(trainer, loss, grad_norm) -> Action``: before the optimizer step (the stability guard); the
  gradients are unscaled and not yet clipped (the detail metrics read them here and never veto);
* ``on_step_end(trainer, result)``: after every attempt, taken or vetoed;
* ``on_log(trainer, record)``: a metrics record (``trainer.log``) for the sinks;
* ``on_checkpoint(trainer, state)``: a checkpoint's state was just written;
* ``on_stop(trainer)``: the run stops early (``trainer.request_stop()``) and can be resumed;
* ``on_train_end(trainer)``: the last step is done; contribute to ``trainer.summary``;
* ``on_close(trainer)``: always, last (files, progress bars).

A callback that holds state across a restart sets ``state_key`` and implements ``state_dict`` /
``load_state_dict``; its state is saved in checkpoints under that key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from lmforge.data.loader import Batch
from lmforge.train.step import Action, StepResult

if TYPE_CHECKING:
    from lmforge.train.trainer import Trainer


class Callback:
    state_key: ClassVar[str | None] = None

    def on_train_start(self, trainer: Trainer) -> None:
        return None

    def on_batches(self, trainer: Trainer, batches: list[Batch]) -> list[Batch]:
        return batches

    def after_micro_batch(self, trainer: Trainer, index: int, n_targets: int, step_targets: int) -> None:
        return None

    def after_backward(self, trainer: Trainer) -> None:
        return None

    def veto(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        return Action.STEP

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        return None

    def on_log(self, trainer: Trainer, record: dict) -> None:
        return None

    def on_checkpoint(self, trainer: Trainer, state: dict) -> None:
        return None

    def on_stop(self, trainer: Trainer) -> None:
        return None

    def on_train_end(self, trainer: Trainer) -> None:
        return None

    def on_close(self, trainer: Trainer) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None
