"""Where the metrics records go (``trainer.log`` -> each callback's ``on_log``), rank 0 only:

* :class:`MetricsFile`: ``RUN/metrics.jsonl`` (one JSON object per line, :class:`MetricsWriter`) and
  TensorBoard, truncated on resume (in TensorBoard a list of numbers, such as an MoE layer's tokens per
  expert, is one scalar per entry, ``KEY/expert_<j>``, and a histogram ``KEY``);
* :class:`Console`: what the user sees, each message once: a progress bar (rich, :class:`ProgressBar`) on
  an interactive terminal, elsewhere a plain log line per record;
* :class:`WandbSink`: with ``metrics.wandb = true``, every record also to Weights & Biases, offline. The
  run is written under ``RUN/wandb/`` (``WANDB_MODE=offline``: nothing leaves the machine; ``wandb sync
  RUN/wandb/offline-run-*`` uploads it later) in project ``metrics.wandb_project`` with the run's config.
  Its id is kept in ``RUN/wandb/run_id``, so a resumed run appends to the same W&B run. Numbers are logged
  under their key at the record's step; an event's numbers under ``EVENT/KEY`` (as in TensorBoard). W&B
  drops records whose step is below one it has seen: after a resume, the lines an interrupted process
  logged past its last checkpoint stay in W&B's history. Needs the ``wandb`` extra.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.progress import Progress, format_duration
from lmforge.train.callbacks import Callback
from lmforge.train.step import StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends records to ``metrics.jsonl``; on resume from step ``resume_step``, first drops the lines
    of later steps (written after that checkpoint by the interrupted process), so each step appears once.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_step: int | None = None):
        # TensorBoard: on resume, events of later steps in older files are purged the same way
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if json.loads(ln)["step"] <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in kept))
            os.replace(tmp, self.path)
        self._fh = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()
        if self._tb is not None:
            step = record["step"]
            prefix = f"{record['event']}/" if "event" in record else ""  # keep events off the main curves
            for key, value in record.items():
                if key != "step" and _number(value):
                    self._tb.add_scalar(prefix + key, value, step)
                elif isinstance(value, list) and value and all(_number(v) for v in value):
                    self._write_list(prefix + key, value, step)

    def _write_list(self, key: str, values: list[float], step: int) -> None:
        """A list of numbers (an MoE layer's tokens per expert, ``moe/layer.<i>/load``): one scalar per
        entry, ``KEY/expert_<j>``, and the list as a histogram under ``KEY`` (TensorBoard's histogram tab
        shows how the load spreads over the experts, step by step). Non-finite entries are left out."""
        for j, v in enumerate(values):
            if math.isfinite(v):
                self._tb.add_scalar(f"{key}/expert_{j}", v, step)
        finite_values = [float(v) for v in values if math.isfinite(v)]
        if finite_values:
            self._tb.add_histogram(key, torch.tensor(finite_values), step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


class ProgressBar:
    """Step progress with ETA, loss, lr and tokens/s; a no-op when stdout is not a terminal."""

    def __init__(self, total: int, start: int, enabled: bool | None = None):
        self.enabled = sys.stdout.isatty() if enabled is None else enabled
        self._progress = None
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            # the ETA is the run's own (in ``info``): rich's would count evaluations as training time
            self._progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}")
            )
            self._task = self._progress.add_task("train", total=total, completed=start, info="")
            self._progress.start()

    def update(self, step: int, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)

    def print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


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


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


COMPILE_TIMES = "lmforge_compile_seconds.json"  # beside torch's compile caches


def compile_times_file() -> Path:
    """Where the first compiled step's time is kept per model: inductor's cache folder, so the figure
    lives and goes with the compiled graphs it describes."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / COMPILE_TIMES


def compile_key(cfg: Config, world: int) -> str:
    """What the first step's compilation depends on: the model, the batch shape, the precision, the
    device, the processes and torch's version."""
    import torch

    t = cfg.train
    parts = [cfg.model.model_dump(mode="json"), cfg.data.vocab_size, cfg.data.seq_len, t.micro_batch_size]
    parts += [t.precision, t.device, t.attention, t.loss_chunk, cfg.optim.name, world, torch.__version__]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def last_compile_s(key: str, path: Path) -> float | None:
    """The last measured first-step time of ``key`` in ``path``; None when never measured (or unreadable)."""
    try:
        value = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None


def record_compile_s(key: str, seconds: float, path: Path) -> None:
    """Keep ``seconds`` as ``key``'s first-step time in ``path`` (a damaged file is started afresh; best
    effort: a read-only cache is fine)."""
    try:
        times = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        times = {}
    times = times if isinstance(times, dict) else {}
    times[key] = round(seconds, 1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError:
        log.debug("could not record the compile time in %s", path)


STEP_LINE_S = 8.0  # piped: a step line at least this often, when train.log_interval steps take longer


def slow_step_line(step: int, total: int, since_line_s: float, steps: int, spent_s: float) -> str | None:
    """Piped, the line that keeps slow training visible between ``train.log_interval`` lines: when
    ``since_line_s`` (since the last line shown) reaches :data:`STEP_LINE_S`, ``step N/T``, the time a
    step took (``spent_s`` over the ``steps`` this process has taken) and the time left at that pace."""
    if since_line_s < STEP_LINE_S or steps < 1 or step >= total:
        return None
    per_step = spent_s / steps
    left = format_duration(per_step * (total - step))
    return f"step {step}/{total} | {per_step:.1f} s a step | eta {left}"


def compiling(cfg: Config, world: int, path: Path) -> Progress:
    """The first compiled step as a phase: "compiling the model", with the time left when this model's
    last compile here was measured, else saying there is no figure yet."""
    last = last_compile_s(compile_key(cfg, world), path)
    if last is None:
        opening = "compiling the model (the first step; no earlier compile of this model timed here)"
    else:
        opening = f"compiling the model, about {format_duration(last)} (its last compile here)"
    return Progress("compiling the model", expected_s=last, opening=opening)


class Console(Callback):
    """What the user sees while a run trains, each message once: on an interactive terminal a progress
    bar (step lines update it, validation lines are printed above it); otherwise (piped, ``nohup``, a
    scheduler's log) a plain log line per step record (every ``train.log_interval`` steps) and per
    evaluation. Guard events are logged by the guard itself, checkpoints by the checkpoint writer."""

    def __init__(self, enabled: bool | None = None, compile_times: Path | None = None):
        self.enabled = enabled  # the progress bar: None = when stdout is a terminal
        self.bar: ProgressBar | None = None
        self.total = 0
        self.compile_times = compile_times  # None: beside torch's compile caches (compile_times_file)
        self.compiling: Progress | None = None
        self._last_line = 0.0
        self._paced = (0.0, 0)

    def on_train_start(self, trainer: Trainer) -> None:
        self.total = trainer.total_steps
        self._last_line = time.monotonic()  # when the last line was shown (piped)
        self._paced = (self._last_line, trainer.progress.step)  # (time, step) the pace is measured from
        cfg = trainer.run.cfg
        if cfg.train.compile and trainer.progress.step < trainer.total_steps:
            # the first step compiles: shown as its own phase; the step bar starts after it
            self.compile_times = self.compile_times or compile_times_file()
            self.compiling = compiling(cfg, trainer.run.layout.world, self.compile_times)
            self.compiling.start_ticking()
        else:
            self._start_bar(trainer)

    def _start_bar(self, trainer: Trainer) -> None:
        self.bar = ProgressBar(trainer.total_steps, trainer.progress.step, self.enabled)
        if not self.bar.enabled:
            self.bar = None

    def _end_compiling(self) -> float | None:
        """Close the compile phase (if open); its time."""
        if self.compiling is None:
            return None
        self.compiling.close()
        spent = self.compiling.clock() - self.compiling.start
        self.compiling = None
        return spent

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        spent = self._end_compiling()
        now = time.monotonic()
        if spent is not None:
            assert self.compile_times is not None
            record_compile_s(
                compile_key(trainer.run.cfg, trainer.run.layout.world), spent, self.compile_times
            )
            self._start_bar(trainer)
            self._paced = (now, trainer.progress.step)  # later steps' pace, without the compile
            self._last_line = now
        if self.bar is None:
            t0, step0 = self._paced
            step = trainer.progress.step
            line = slow_step_line(step, self.total, now - self._last_line, step - step0, now - t0)
            if line is not None:
                log.info("%s", line)
                self._last_line = now

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
                self._last_line = time.monotonic()
        elif "val_loss" in record:
            text = f"step {record['step']}/{self.total} | val_loss {record['val_loss']:.4f}"
            if "val_ppl" in record:
                text += f" (ppl {record['val_ppl']:.2f})"
            if "val_rewards/accuracies" in record:  # DPO's held-out pairs
                text += (
                    f" | reward accuracy {record['val_rewards/accuracies']:.3f}, "
                    f"margin {record['val_rewards/margins']:.3f}"
                )
            if self.bar is not None:
                self.bar.print(text)
            else:
                log.info("%s", text)
                self._last_line = time.monotonic()

    def on_close(self, trainer: Trainer) -> None:
        if self.compiling is not None:  # the first step never ended (an error, a stop)
            self.compiling.abandon()
            self.compiling = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def require_wandb() -> None:
    """UserError unless ``wandb`` can be imported (checked before any work)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise UserError('metrics.wandb: the wandb package is missing; pip install -e ".[wandb]"') from None


def wandb_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``record`` as W&B keys: ``KEY``, or ``EVENT/KEY`` for an event; no ``step``."""
    prefix = f"{record['event']}/" if "event" in record else ""
    return {
        prefix + k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class WandbSink(Callback):
    """Logs each record to an offline W&B run in ``RUN/wandb`` (resumed by the id stored there)."""

    def __init__(self, run_dir: Path, cfg: Config):
        require_wandb()
        self.dir = Path(run_dir) / "wandb"
        self.cfg = cfg
        self.run = None

    def run_id(self) -> str:
        """The stored id, or a new one stored for the next resume."""
        path = self.dir / "run_id"
        if path.is_file():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id + "\n")
        return run_id

    def on_train_start(self, trainer: Trainer) -> None:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_MODE"] = "offline"
        self.run = wandb.init(
            mode="offline",
            dir=str(self.dir),
            project=self.cfg.metrics.wandb_project,
            id=self.run_id(),
            resume="allow",
            config=self.cfg.model_dump(mode="json", exclude_none=True),
        )

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if self.run is not None:
            values = wandb_values(record)
            if values:
                self.run.log(values, step=record["step"])

    def on_close(self, trainer: Trainer) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
