"""Metrics callbacks: the per-step record, its sinks (``metrics.jsonl`` + TensorBoard) and the console
progress bar."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lmforge.train.callbacks.base import Callback
from lmforge.train.metrics import MetricsWriter, ProgressBar
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer


class StepMetrics(Callback):
    """Every ``train.log_interval`` steps (and the last): loss, lr, gradient norm before clipping, clip
    ratio and threshold, clipped steps since the previous line, tokens/s over that window, tokens seen,
    epoch, and the loader's report (phase and mix of a mixture)."""

    def __init__(self) -> None:
        self._t = 0.0
        self._tokens = 0
        self._clipped: torch.Tensor | int = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self._t, self._tokens, self._clipped = time.perf_counter(), 0, 0

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if result.action is not Action.STEP:
            return
        self._tokens += trainer.run.tokens_per_step
        self._clipped = self._clipped + (result.clip.ratio < 1)  # stays on the device until logged
        step = trainer.progress.step
        if step % trainer.run.cfg.train.log_interval and step != trainer.total_steps:
            return
        now = time.perf_counter()
        record = {
            "step": step,
            "loss": float(result.loss),
            "lr": trainer.lr,
            "grad_norm": float(result.grad_norm),
            "clip_ratio": float(result.clip.ratio),
            "clipped_steps": int(self._clipped),
            "tokens_per_s": self._tokens / (now - self._t),
            "tokens_seen": trainer.progress.tokens_seen,
            "epoch": trainer.run.loader.epoch,
            **trainer.run.loader.report(),
        }
        if result.clip.threshold is not None:
            record["clip_threshold"] = float(result.clip.threshold)
        trainer.log(record)
        self._t, self._tokens, self._clipped = now, 0, 0


class MetricsFile(Callback):
    """Writes every record to ``RUN/metrics.jsonl`` and TensorBoard; on resume, first drops the lines an
    interrupted process wrote after its last checkpoint."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.writer: MetricsWriter | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        resume_step = trainer.progress.step if trainer.resumed else None
        self.writer = MetricsWriter(self.run_dir, resume_step=resume_step)

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def on_close(self, trainer: Trainer) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class ProgressBarCallback(Callback):
    """The console progress bar (interactive terminals only, unless ``enabled`` says otherwise)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled
        self.bar: ProgressBar | None = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.bar = ProgressBar(trainer.total_steps, trainer.progress.step, self.enabled)

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if self.bar is None:
            return
        if "tokens_per_s" in record:  # a step line (guard events carry a loss too)
            info = f"loss {record['loss']:.3f} lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s"
            self.bar.update(record["step"], info)
        elif "val_loss" in record:
            self.bar.print(f"step {record['step']}: val_loss {record['val_loss']:.4f}")

    def on_close(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
