"""The trainer: it only sequences. Next batches (as many as the batch schedule says:
``optim/batch_schedule.py``), one step, callbacks; everything else is a callback
(``train/callbacks/``): evaluation, checkpoints, metrics, the progress bar, the stability guard, the
end-of-run sample.

State that survives a restart is :meth:`Trainer.state_dict`: the model, optimizer, loader, progress,
schedule, clipper, gradient transforms (the noise's step count), the batch schedule, DDP's gradient compression (PowerSGD's
error feedback, per rank), precision policy, random generators, and each stateful callback's state under its
``state_key``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmforge.config import BatchScheduleConfig
from lmforge.data.loader import Batch
from lmforge.optim.batch_schedule import BatchSchedule
from lmforge.optim.noise_scale import first_micro_batch_sq
from lmforge.parallel.apply import activation_offload
from lmforge.train.build import Run
from lmforge.train.callbacks import Callback
from lmforge.train.checkpoint import load_optimizer_state, optimizer_state
from lmforge.train.runtime import check_runtime_state, rng_state, runtime_state, set_rng_state
from lmforge.train.step import SEVERITY, Action, StepResult, train_step


@dataclass
class Progress:
    """Counters that survive a restart."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": self.elapsed_s}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen, self.elapsed_s = state["step"], state["tokens_seen"], state["elapsed_s"]


class Trainer:
    """Runs ``run`` to ``train.steps`` optimizer steps, calling ``callbacks`` in their list order."""

    def __init__(self, run: Run, callbacks: Sequence[Callback] = ()):
        self.run = run
        self.callbacks = list(callbacks)
        self.progress = Progress()
        self.total_steps = run.cfg.train.steps
        self.attempt = 0  # step attempts in this process, vetoed ones included; each value comes once
        self.lr = 0.0  # learning rate of the current attempt
        self.lr_scale = 1.0  # set by callbacks that change the rate (the guard's rollbacks)
        self.resumed = False
        self.stop_requested = False
        self.end_requested = False  # end now as a finished run (early stopping): on_train_end, a summary
        self.stop_reason = ""  # why the run stopped early (e.g. "SIGTERM"), for the user
        self.step_time_s = 0.0  # wall time of the last attempt's batches and step, callbacks excluded
        self.data_time_s = 0.0  # of which waiting for the batches (``_next_batches``)
        self.summary: dict = {}  # filled by callbacks at the end of the run
        # train.batch_schedule: micro-batches of each step and the learning rate's factor
        self.batch_schedule = run.batch_schedule or BatchSchedule(
            BatchScheduleConfig(), run.accum, run.accum, 1
        )
        self.step_tokens = run.tokens_per_step  # tokens of the current attempt, over all ranks
        self._small: tuple[int, torch.Tensor, int] | None = None  # the noise rule's measurement this step

    # -- the loop -----------------------------------------------------------------------------------

    def fit(self) -> None:
        """Train until ``train.steps`` or until a callback asks to stop."""
        self._emit("on_train_start")
        try:
            last = time.perf_counter()
            while self.progress.step < self.total_steps and not (self.stop_requested or self.end_requested):
                start = time.perf_counter()
                batches = self._next_batches()
                self.data_time_s = time.perf_counter() - start
                result = self._attempt(batches)
                self.step_time_s = time.perf_counter() - start
                self._emit("on_step_end", result)
                now = time.perf_counter()
                self.progress.elapsed_s, last = self.progress.elapsed_s + now - last, now
            self._emit("on_stop" if self.stop_requested else "on_train_end")
        finally:
            self._emit("on_close")

    def _next_batches(self) -> list[Batch]:
        accum = self.batch_schedule.accum_at(
            self.progress.tokens_seen
        )  # the batch schedule's size of this step
        batches = [self.run.loader.next_batch() for _ in range(accum)]
        for cb in self.callbacks:
            batches = cb.on_batches(self, batches)
        return batches

    def _attempt(self, batches: list[Batch]) -> StepResult:
        run = self.run
        self.lr = (
            run.cfg.optim.lr
            * run.schedule(self.progress.step)
            * self.batch_schedule.lr_factor()
            * self.lr_scale
        )
        self.step_tokens = run.tokens_of(len(batches))
        self._small = None
        with activation_offload(run.cfg.train.activation_offload):
            result = train_step(
                run.module,
                run.optimizer,
                batches,
                self.lr,
                run.clipper,
                run.precision,
                observers=[self],
                reduce=run.reduce,
                transforms=run.transforms,
            )
        self.attempt += 1
        if result.action is Action.STEP:
            self.progress.step += 1
            self.progress.tokens_seen += self.step_tokens
            if self._small is not None:  # the noise rule's measurement (first micro-batch, whole step)
                self.batch_schedule.observe(
                    self.progress.step, *self._small, result.grad_norm.float().square()
                )
        return result

    # -- what the step calls back (train/step.py's StepObserver) -------------------------------------

    def after_micro_batch(self, index: int, n_targets: int, step_targets: int) -> None:
        if index == 0 and self.batch_schedule.measures:
            self._small = self._first_micro_batch(n_targets, step_targets)
        self._emit("after_micro_batch", index, n_targets, step_targets)

    def _first_micro_batch(self, n_targets: int, step_targets: int) -> tuple[int, torch.Tensor, int] | None:
        """``(B_small, |G_small|^2, B_big)`` of this step for the noise rule, ``|G_small|^2`` averaged over
        the data-parallel ranks (each holds its own first micro-batch's gradient), so that every rank
        decides the same batch."""
        run = self.run
        sq = first_micro_batch_sq(
            run.model.parameters(), n_targets, step_targets, run.layout.dp, run.precision.loss_scale
        )
        if sq is None:
            return None
        if run.layout.dp > 1:
            sq = sq.clone()
            dist.all_reduce(sq, group=run.layout.group("dp"))
            sq /= run.layout.dp
        return n_targets, sq, step_targets

    def after_backward(self) -> None:
        self._emit("after_backward")

    def veto(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        verdicts = [cb.veto(self, loss, grad_norm) for cb in self.callbacks]
        return max(verdicts, key=SEVERITY.__getitem__, default=Action.STEP)

    # -- for callbacks -------------------------------------------------------------------------------

    def log(self, record: dict) -> None:
        """Hand a metrics record to every callback's ``on_log`` (the sinks)."""
        for cb in self.callbacks:
            cb.on_log(self, record)

    def request_stop(self, reason: str = "") -> None:
        """End the run after the current step, resumably (``on_stop`` instead of ``on_train_end``)."""
        self.stop_requested = True
        self.stop_reason = self.stop_reason or reason

    def request_end(self, reason: str = "") -> None:
        """End the run after the current step as a finished one (``on_train_end``, ``summary.json``),
        e.g. early stopping; ``request_stop`` instead ends it resumably."""
        self.end_requested = True
        self.stop_reason = self.stop_reason or reason

    def _emit(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        run = self.run
        state = {
            "model": run.module.state_dict(),
            "optimizer": optimizer_state(run.model, run.optimizer),
            "loader": run.loader.state_dict(),
            "progress": self.progress.state_dict(),
            "scheduler": run.schedule.state_dict(),
            "clip": run.clipper.state_dict(),
            "grad_transforms": run.transforms.state_dict(),
            "batch_schedule": self.batch_schedule.state_dict(),
            "comm": run.comm.state_dict() if run.comm is not None else {},
            "rollouts": run.module.rank_state(),
            "precision": run.precision.state_dict(),
            "rng": rng_state(),
            "runtime": runtime_state(),
        }
        for cb in self.callbacks:
            if cb.state_key is not None:
                state[cb.state_key] = cb.state_dict()
        return state

    def restore(self, state: dict) -> None:
        """The training state proper (model, optimizer, progress, schedule, clipping, precision): what
        both a resume and a rollback restore. The loader, RNG and callbacks are :meth:`load_state_dict`'s."""
        run = self.run
        run.module.load_state_dict(state["model"])
        load_optimizer_state(run.model, run.optimizer, state["optimizer"])
        self.progress.load_state_dict(state["progress"])
        run.schedule.load_state_dict(state["scheduler"])
        run.clipper.load_state_dict(state["clip"])
        run.transforms.load_state_dict(state.get("grad_transforms", {}))
        self.batch_schedule.load_state_dict(state.get("batch_schedule", {}))
        if run.comm is not None:  # PowerSGD's error feedback and Q, this rank's (per-rank in checkpoints)
            run.comm.load_state_dict(state.get("comm", {}))
        run.precision.load_state_dict(state.get("precision", {}))

    def load_state_dict(self, state: dict) -> None:
        """Resume from a checkpoint's state."""
        self.restore(state)
        self.run.loader.load_state_dict(state["loader"])
        self.run.module.load_rank_state(state.get("rollouts", {}))
        set_rng_state(state["rng"])
        check_runtime_state(state.get("runtime", {}), self.run.cfg.train.deterministic)
        for cb in self.callbacks:
            if cb.state_key is not None and cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])
        self.resumed = True
