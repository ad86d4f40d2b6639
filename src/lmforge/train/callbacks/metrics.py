"""Metrics callbacks: the per-step record, its sinks (``metrics.jsonl`` + TensorBoard) and the console."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from lmforge.train.callbacks.base import Callback
from lmforge.train.metrics import MetricsWriter, ProgressBar
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def eta_seconds(remaining: int, step_s: float, overhead_s: float, done: int) -> float:
    """Seconds left: ``remaining * (step_s + overhead_s / done)``.

    ``step_s`` is the smoothed time of one training step (batches, forward, backward, optimizer) and
    ``overhead_s`` the time spent outside steps (evaluations, checkpoints) over the ``done`` steps of this
    process so far, spread evenly: the estimate does not jump after an evaluation or a checkpoint."""
    return remaining * (step_s + overhead_s / max(done, 1))


class StepMetrics(Callback):
    """Every ``train.log_interval`` steps (and the last): loss, lr, gradient norm before clipping, clip
    ratio and threshold, clipped steps since the previous line, the loss scale (fp16), tokens/s of the training steps over that
    window, the ETA (:func:`eta_seconds`), tokens seen, epoch, and the loader's report (phase and mix of
    a mixture).

    Timing: the first step of a process (compilation, warm caches) is kept apart, as long as later steps
    exist to measure; evaluations and checkpoints are not training time: they enter the ETA spread over
    the steps done, so the ETA does not jump after them."""

    SMOOTHING = 0.3  # weight of the newest window in the step-time average

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._window_s = 0.0  # training-step time in the current window
        self._window_steps = 0
        self._clipped: torch.Tensor | int = 0
        self._start = 0.0
        self._steps = 0  # steps done by this process
        self._train_s = 0.0  # training-step time of this process, first step apart
        self._first_s = 0.0  # the first step of this process
        self._step_s: float | None = None  # smoothed seconds per step

    def on_train_start(self, trainer: Trainer) -> None:
        self._reset()
        self._start = time.perf_counter()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        dt = trainer.step_time_s
        if result.action is Action.STEP and self._steps == 0:
            self._first_s = dt
        else:
            self._window_s += dt
            self._train_s += dt
        if result.action is not Action.STEP:
            return
        self._steps += 1
        self._window_steps += self._steps > 1
        self._clipped = self._clipped + (result.clip.ratio < 1)  # stays on the device until logged
        step = trainer.progress.step
        if step % trainer.run.cfg.train.log_interval and step != trainer.total_steps:
            return
        if self._window_steps:
            per_step = self._window_s / self._window_steps
        else:  # only the first step so far: it is all there is to go by
            per_step = self._first_s
        a = self.SMOOTHING
        self._step_s = per_step if self._step_s is None else a * per_step + (1 - a) * self._step_s
        overhead = time.perf_counter() - self._start - self._train_s - self._first_s
        record = {
            "step": step,
            "loss": float(result.loss),
            "lr": trainer.lr,
            "grad_norm": float(result.grad_norm),
            "clip_ratio": float(result.clip.ratio),
            "clipped_steps": int(self._clipped),
            "tokens_per_s": trainer.run.tokens_per_step / per_step if per_step > 0 else 0.0,
            "eta_s": eta_seconds(trainer.total_steps - step, self._step_s, max(overhead, 0.0), self._steps),
            "tokens_seen": trainer.progress.tokens_seen,
            "epoch": trainer.run.loader.epoch,
            **trainer.run.loader.report(),
        }
        if result.clip.threshold is not None:
            record["clip_threshold"] = float(result.clip.threshold)
        if trainer.run.precision.scaler is not None:  # fp16: the scale the next step uses
            record["loss_scale"] = trainer.run.precision.loss_scale
        pipeline = getattr(trainer.run.objective, "pipeline", None)
        if pipeline is not None:  # measured on rank 0 (the first stage) in the step's last micro-batch
            record["pp_bubble"] = pipeline.last_bubble
            record["pp_bubble_formula"] = pipeline.expected_bubble
        trainer.log(record)
        self._window_s, self._window_steps, self._clipped = 0.0, 0, 0


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


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m"``, ``125`` -> ``"2m05s"``, ``7`` -> ``"7s"``."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Console(Callback):
    """What the user sees while a run trains, each message once: on an interactive terminal a progress
    bar (step lines update it, validation lines are printed above it); otherwise (piped, ``nohup``, a
    scheduler's log) a plain log line per step record (every ``train.log_interval`` steps) and per
    evaluation. Guard events are logged by the guard itself, checkpoints by the checkpoint writer."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = enabled  # the progress bar: None = when stdout is a terminal
        self.bar: ProgressBar | None = None
        self.total = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self.total = trainer.total_steps
        self.bar = ProgressBar(trainer.total_steps, trainer.progress.step, self.enabled)
        if not self.bar.enabled:
            self.bar = None

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if "event" in record:
            return
        if "tokens_per_s" in record:
            info = (
                f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | {record['tokens_per_s']:,.0f} tok/s"
                f" | eta {format_duration(record['eta_s'])}"
            )
            if self.bar is not None:
                self.bar.update(record["step"], info)
            else:
                log.info("step %d/%d | %s", record["step"], self.total, info)
        elif "val_loss" in record:
            text = f"step {record['step']}/{self.total} | val_loss {record['val_loss']:.4f} (ppl {record['val_ppl']:.2f})"
            if self.bar is not None:
                self.bar.print(text)
            else:
                log.info("%s", text)

    def on_close(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
