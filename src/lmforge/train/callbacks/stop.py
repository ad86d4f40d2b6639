"""Stopping a run early and resumably."""

from __future__ import annotations

from lmforge.train.callbacks.base import Callback
from lmforge.train.step import StepResult
from lmforge.train.trainer import Trainer


class StopAfter(Callback):
    """Stop once ``step`` optimizer steps are done, as an interruption would: a checkpoint of that step is
    written (``on_stop``) and ``--resume`` continues from it; the schedule still spans ``train.steps``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.progress.step >= self.step:
            trainer.request_stop()
