"""What follows the step count alone: stopping a run early and resumably, on a signal
(:class:`StopOnSignal`) or after a given step (:class:`StopAfter`, for tests and budgets), and
quantization-aware training's switch (:class:`QATSwitch`). Either stop loses nothing.

SIGINT (Ctrl-C) and SIGTERM (a scheduler's notice before preemption): the first signal lets the current
step finish; the run then stops as a callback's ``request_stop`` would: a checkpoint of that step is
written (``Checkpointing.on_stop``) and ``lmforge train --resume`` continues from it. A second signal
exits at once (:class:`~lmforge.errors.Interrupted`; an incomplete checkpoint folder is removed on the
next start). Under ``torchrun`` every rank agrees at each step end on whether any rank was signalled
(:func:`any_rank`), so all stop after the same step.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from lmforge.errors import Interrupted
from lmforge.model.qat import set_fake_quant
from lmforge.train.callbacks import Callback
from lmforge.train.step import StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def any_rank(flag: bool) -> bool:
    """``flag`` or'ed over every rank of the default process group (itself without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class StopOnSignal(Callback):
    """Installs handlers for :data:`STOP_SIGNALS` while the trainer runs (main thread only; elsewhere
    signals keep their handlers) and restores the previous ones when it closes. A signal the process was
    started with ignored (SIGINT of a background job of a non-interactive shell) stays ignored, as Python
    itself leaves it."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._step = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self._step = trainer.progress.step
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored on purpose (nohup, `cmd &`)
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is not None:
            raise Interrupted(sig)
        self.received = sig
        log.warning(
            "%s: finishing step %d, then writing a checkpoint and stopping (send it again to exit at once)",
            sig.name,
            self._step + 1,
        )

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._step = trainer.progress.step
        if any_rank(self.received is not None):
            trainer.request_stop(
                self.received.name if self.received is not None else "a signal on another rank"
            )

    def on_close(self, trainer: Trainer) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class StopAfter(Callback):
    """Stop once ``step`` optimizer steps are done, as an interruption would: a checkpoint of that step is
    written (``on_stop``) and ``--resume`` continues from it; the schedule still spans ``train.steps``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.progress.step >= self.step:
            trainer.request_stop()


class QATSwitch(Callback):
    """Quantization-aware training's switch (``[qat]``, ``model/qat.py``): the fake quantizers are on for
    step ``s`` (counting completed optimizer steps from 0) exactly when ``s >= qat.start_step``.

    It holds no state of its own: the switch follows from the step count, which the checkpoint restores,
    so a resumed run trains each step as the uninterrupted one did. It is set before the first step and
    after every step (before that step's evaluation, which therefore scores the model as the next step
    trains it)."""

    def __init__(self, start_step: int):
        self.start_step = start_step

    def _set(self, trainer: Trainer) -> None:
        set_fake_quant(trainer.run.model, trainer.progress.step >= self.start_step)

    def on_train_start(self, trainer: Trainer) -> None:
        self._set(trainer)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._set(trainer)
