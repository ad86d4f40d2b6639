"""Checkpoints: every ``train.checkpoint_interval`` steps, when the run is stopped early, and at the end."""

from __future__ import annotations

from pathlib import Path

from lmforge.config import Config
from lmforge.train.callbacks.base import Callback
from lmforge.train.checkpoint import save_checkpoint
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer


def config_state(cfg: Config) -> dict:
    """The resolved config as saved inside a checkpoint's state (checked on resume)."""
    return cfg.model_dump(mode="json", exclude_none=True)


class Checkpointing(Callback):
    """Writes ``RUN/checkpoints/step_N/`` atomically (``train/checkpoint.py``) and tells the other
    callbacks (``on_checkpoint``) what it wrote: the guard keeps it as its rollback point."""

    def __init__(self, run_dir: Path, config_toml: str):
        self.run_dir, self.config_toml = run_dir, config_toml
        self._saved_step = -1

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        interval, step = trainer.run.cfg.train.checkpoint_interval, trainer.progress.step
        if result.action is Action.STEP and interval and step % interval == 0 and step < trainer.total_steps:
            self.save(trainer)

    def on_stop(self, trainer: Trainer) -> None:
        if self._saved_step != trainer.progress.step:
            self.save(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        state = trainer.state_dict()
        state["config"] = config_state(trainer.run.cfg)
        step = trainer.progress.step
        save_checkpoint(self.run_dir, step, state, self.config_toml, trainer.run.cfg.train.keep_checkpoints)
        self._saved_step = step
        for cb in trainer.callbacks:
            cb.on_checkpoint(trainer, state)
