"""Quantization-aware training's switch (``[qat]``, ``model/qat.py``): the fake quantizers are on for
step ``s`` (counting completed optimizer steps from 0) exactly when ``s >= qat.start_step``.

It holds no state of its own: the switch follows from the step count, which the checkpoint restores, so
a resumed run trains each step as the uninterrupted one did. It is set before the first step and after
every step (before that step's evaluation, which therefore scores the model as the next step trains it).
"""

from __future__ import annotations

from lmforge.model.qat import set_fake_quant
from lmforge.train.callbacks import Callback
from lmforge.train.step import StepResult
from lmforge.train.trainer import Trainer


class QATSwitch(Callback):
    """Fake quantization on from ``start_step`` (see the module docstring)."""

    def __init__(self, start_step: int):
        self.start_step = start_step

    def _set(self, trainer: Trainer) -> None:
        set_fake_quant(trainer.run.model, trainer.progress.step >= self.start_step)

    def on_train_start(self, trainer: Trainer) -> None:
        self._set(trainer)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._set(trainer)
