"""``train.profile_steps = [A, B]``: a ``torch.profiler`` trace of steps A..B.

The profiler starts before step A's batches are read (at the end of step A - 1, or at the start of the
run when A is its first step) and stops after step B's end-of-step callbacks, so the trace holds whole
steps: batches, forward, backward, optimizer step, and the callbacks of those steps. It records CPU
activity, and CUDA kernels when the run is on a GPU. Rank 0 writes ``RUN/profile/trace.json`` (open it
in Perfetto or ``chrome://tracing``), other ranks ``trace_rank{r}.json``; rank 0 also writes
``RUN/profile/top_ops.txt``, the 20 operators with the most self time (``key_averages``), and logs it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lmforge.train.callbacks import Callback
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)

TOP_OPS = 20


class Profile(Callback):
    """Profiles steps ``first..last`` (inclusive, counted as ``trainer.progress.step`` counts them)."""

    def __init__(self, run_dir: Path, first: int, last: int):
        self.out = Path(run_dir) / "profile"
        self.first, self.last = first, last
        self.prof: profile | None = None
        self.cuda = False

    def on_train_start(self, trainer: Trainer) -> None:
        self.cuda = trainer.run.device.type == "cuda"
        if trainer.progress.step == self.first - 1:
            self._start()
        elif trainer.progress.step >= self.first and trainer.run.layout.is_main:
            log.info("profile: steps %d..%d are already done; no profile", self.first, self.last)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if result.action is not Action.STEP:
            return
        step = trainer.progress.step
        if step == self.first - 1 and self.prof is None:
            self._start()
        elif step == self.last and self.prof is not None:
            self._finish(trainer)

    def on_close(self, trainer: Trainer) -> None:
        if self.prof is not None:  # the run ended inside the window: keep what was traced
            self._finish(trainer)

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities)
        self.prof.start()

    def _finish(self, trainer: Trainer) -> None:
        prof, self.prof = self.prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        rank = trainer.run.layout.rank
        self.out.mkdir(parents=True, exist_ok=True)
        trace = self.out / ("trace.json" if rank == 0 else f"trace_rank{rank}.json")
        prof.export_chrome_trace(str(trace))
        if rank != 0:
            return
        table = top_ops_table(prof, self.cuda)
        (self.out / "top_ops.txt").write_text(table + "\n")
        log.info("profile of steps %d..%d: %s\n%s", self.first, self.last, trace, table)


def top_ops_table(prof: profile, cuda: bool, rows: int = TOP_OPS) -> str:
    """The ``rows`` operators with the most self time (the device's on CUDA, else the host's)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)
