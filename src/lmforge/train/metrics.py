"""Metrics sinks: ``metrics.jsonl`` (one JSON object per line), TensorBoard, and a console progress bar.

The progress bar (rich) shows only on an interactive terminal; elsewhere the ``Console`` callback logs a
plain line per metrics record instead.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any


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
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(prefix + key, value, step)

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
