"""Checkpoints: every ``train.checkpoint_interval`` steps, when the run is stopped early, and at the end.

With ``train.async_checkpoint`` a checkpoint's tensors are written in the background: training goes on
and the checkpoint is completed (renamed into place) at the first step end after its write finished; the
metrics line ``{"event": "checkpoint", "step": S, "completed_during_step": T}`` records which step it
overlapped. A new save, a stop and the end of the run first wait for a pending one.

With ``train.checkpoint_full_every = N`` (N > 1) the callback writes one full checkpoint, then N - 1
differential ones against it (``train/checkpoint.py``), and so on; the first checkpoint of a process
(a fresh run or a resume) is full, as is a re-save of the base's own step. Each checkpoint's metrics line
``{"event": "checkpoint_written", "step", "kind": "full" | "differential", "written_fraction"}`` gives the
share of the state's tensor bytes it wrote (whole tensors' sizes, not this rank's shards).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.train.callbacks import Callback
from lmforge.train.checkpoint import (
    TENSOR_KEYS,
    Differential,
    PendingSave,
    digests,
    save_checkpoint,
    unchanged_keys,
)
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
        self.pending: PendingSave | None = None
        self._base: tuple[str, dict[str, str]] | None = None  # the last full save: its folder, digests
        self._since_full = 0  # differential saves since it

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.pending is not None and self.pending.done():
            self._complete(trainer)
        interval, step = trainer.run.cfg.train.checkpoint_interval, trainer.progress.step
        if result.action is Action.STEP and interval and step % interval == 0 and step < trainer.total_steps:
            self.save(trainer, background=trainer.run.cfg.train.async_checkpoint)

    def on_stop(self, trainer: Trainer) -> None:
        if self._saved_step != trainer.progress.step:
            self.save(trainer)
        self._complete(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self.save(trainer)

    def on_close(self, trainer: Trainer) -> None:
        if self.pending is not None:  # an exception ended the run: still finish what was being written
            self._complete(trainer)

    def _complete(self, trainer: Trainer) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.finish()
        if pending.future is not None:
            trainer.log(
                {"event": "checkpoint", "step": pending.step, "completed_during_step": trainer.progress.step}
            )

    def save(self, trainer: Trainer, background: bool = False) -> None:
        self._complete(trainer)
        state = trainer.state_dict()
        state["config"] = config_state(trainer.run.cfg)
        step = trainer.progress.step
        keep = trainer.run.cfg.train.keep_checkpoints
        group = trainer.run.layout.checkpoint_group
        differential = self._differential(trainer, state, step)
        self.pending = save_checkpoint(
            self.run_dir, step, state, self.config_toml, keep, background, group, differential
        )
        if not background:
            self.pending = None
        self._saved_step = step
        for cb in trainer.callbacks:
            cb.on_checkpoint(trainer, state)

    def _differential(self, trainer: Trainer, state: dict, step: int) -> Differential | None:
        """The record of a differential save of ``state`` at ``step``, or None for a full one (then its
        digests become the new base's); logs which it is."""
        every = trainer.run.cfg.train.checkpoint_full_every
        if every == 1:
            return None
        tensors = {k: state[k] for k in TENSOR_KEYS}
        now = digests(tensors)
        name = f"step_{step:08d}"
        base = self._base
        full = base is None or base[0] == name or self._since_full >= every - 1
        full = full or not (self.run_dir / "checkpoints" / base[0]).is_dir()
        record = None
        if full:
            self._base, self._since_full = (name, now), 0
        else:
            record = Differential(base[0], unchanged_keys(now, base[1]))
            self._since_full += 1
        total = written = 0
        for part, entries in tensors.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    size = value.numel() * value.element_size()
                    total += size
                    written += size if record is None or f"{part}.{key}" not in record.from_base else 0
        trainer.log(
            {
                "event": "checkpoint_written",
                "step": step,
                "kind": "full" if record is None else "differential",
                "written_fraction": written / total if total else 1.0,
            }
        )
        return record
