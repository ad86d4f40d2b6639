"""Periodic and final evaluation on the validation stream and the summary's loss figures
(:class:`Evaluation`); early stopping on the validation loss, keeping the best checkpoint
(:class:`EarlyStopping`).

Early stopping: every validation loss the ``Evaluation`` callback logs is judged: a new best (strictly
lower) resets the count and makes sure a checkpoint of that step exists (written now unless the
checkpoint interval just wrote one) and is named in ``RUN/best.json``, which checkpoint rotation never
removes (``train/checkpoint.py::prune``); otherwise the count grows, and at ``train.early_stop_patience``
evaluations in a row without a new best the run ends like a finished one (``trainer.request_end``):
the final evaluation, checkpoint and sample, ``summary.json`` with ``early_stopped``, ``best_step``,
``best_val_loss`` and ``best_checkpoint``, and the event ``{"event": "early_stop", ...}`` in
``metrics.jsonl``. Under several processes rank 0's loss is the one judged, so every rank decides alike.

Downstream tasks during training (``[eval]``, :class:`TaskEvaluation`): scores and regression events, in
every process layout; the checkpoint of a task's best score kept (:class:`BestTaskCheckpoint`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import Config
from lmforge.data.loader import eval_batches
from lmforge.errors import ConfigError
from lmforge.evaluate.task_scoring import resolve_tasks, score_text_task
from lmforge.evaluate.validation import eval_targets, perplexity, unigram_loss
from lmforge.posttrain.run import posttrain_validation
from lmforge.progress import Progress
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.checkpointing import Checkpointing
from lmforge.train.callbacks.sample import whole_model
from lmforge.train.checkpoint import write_best, write_best_task
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer


def validation_loss(trainer: Trainer) -> float:
    """Mean validation loss over ``train.eval_tokens`` tokens, in the run's precision (the training
    module's evaluation)."""
    run, t = trainer.run, trainer.run.cfg.train
    batches = eval_batches(run.val, run.cfg.data.seq_len, t.micro_batch_size, t.eval_tokens)
    return run.module.evaluate(batches, run.precision)["val_loss"]


class Evaluation(Callback):
    """Every ``train.eval_interval`` steps (not at the last, which :meth:`on_train_end` covers): the
    validation loss, logged and shown to the schedule (``plateau`` reacts to it). A run that ends at a
    step just evaluated (early stopping) reuses that figure."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None  # (step, val_loss) of the latest evaluation
        self._extra: dict = {}  # its other figures (DPO's eval_rewards/...)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        interval, step = trainer.run.cfg.train.eval_interval, trainer.progress.step
        if result.action is Action.STEP and interval and step % interval == 0 and step < trainer.total_steps:
            val_loss = self._evaluate(trainer)
            if val_loss is not None:
                trainer.run.schedule.observe(val_loss)

    def on_train_end(self, trainer: Trainer) -> None:
        run = trainer.run
        if self._last is not None and self._last[0] == trainer.progress.step:
            val_loss = self._last[1]
        else:
            val_loss = self._evaluate(trainer)
        if run.val is None:  # the objective's held-out records: no unigram baseline of a token stream
            if val_loss is not None:
                trainer.summary.update({"val_loss": val_loss, **self._extra})
            return
        targets = eval_targets(run.val, run.cfg.data.seq_len, run.cfg.train.eval_tokens)
        uni = unigram_loss(run.data.unigram_counts, targets)
        trainer.summary.update(
            {
                "val_loss": val_loss,
                "val_ppl": perplexity(val_loss),
                "unigram_loss": uni,
                "val_loss_over_unigram": val_loss / uni,
            }
        )

    def _evaluate(self, trainer: Trainer) -> float | None:
        run = trainer.run
        # shown only if it lasts (a first evaluation may compile kernels of its own); lines, not a bar:
        # the training bar is live
        with Progress("evaluating", opening="", tty=False) as shown, shown.ticking():
            if run.val is not None:  # a validation token stream (lm)
                val_loss, self._extra = validation_loss(trainer), {}
            else:
                val_loss, self._extra = posttrain_validation(run.cfg, run.data, run.module, run.precision)
        if val_loss is None:  # no held-out records
            return None
        step = trainer.progress.step
        self._last = (step, val_loss)
        record = {"step": step, "val_loss": val_loss, **self._extra}
        if run.cfg.train.objective not in ("dpo", "rl", "reward"):  # no per-token likelihood
            record["val_ppl"] = perplexity(val_loss)
        trainer.log(record)  # Console shows it
        return val_loss


log = logging.getLogger(__name__)


class EarlyStopping(Callback):
    """Ends the run after ``patience`` evaluations in a row without a new best validation loss; keeps
    the best step's checkpoint. Place it after ``Evaluation`` and ``Checkpointing``."""

    state_key = "early_stop"

    def __init__(self, run_dir: Path, patience: int):
        self.run_dir, self.patience = Path(run_dir), patience
        self.best = math.inf
        self.best_step = -1
        self.bad = 0  # evaluations since the best
        self.stopped = False
        self._pending: tuple[int, float] | None = None  # an evaluation logged during this hook
        self._saved_step = -1  # step of the newest checkpoint written

    def on_train_start(self, trainer: Trainer) -> None:
        if self.stopped and self.bad >= self.patience:  # a resumed run that had stopped early stays stopped
            log.info(
                "early stop: this run stopped at step %d; raise train.early_stop_patience above %d (or set it "
                "to 0) to train on",
                trainer.progress.step, self.bad,
            )  # fmt: skip
            trainer.request_end("early stop")
        else:
            self.stopped = False

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if "val_loss" in record and "event" not in record:
            self._pending = (record["step"], record["val_loss"])

    def on_checkpoint(self, trainer: Trainer, state: dict) -> None:
        self._saved_step = state["progress"]["step"]

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._pending is None:
            return
        step, val_loss = self._pending
        self._pending = None
        self._judge(trainer, step, val_loss)
        if self.bad >= self.patience and not self.stopped:
            self.stopped = True
            event = {
                "step": step,
                "event": "early_stop",
                "evaluations_without_improvement": self.bad,
                "best_step": self.best_step,
                "best_val_loss": self.best,
            }
            trainer.log(event)
            log.info(
                "early stop at step %d: %d evaluations without a new best (best %.4f at step %d)",
                step, self.bad, self.best, self.best_step,
            )  # fmt: skip
            trainer.request_end("early stop")

    def on_train_end(self, trainer: Trainer) -> None:
        if self._pending is not None:  # the final evaluation (the final checkpoint is already written)
            step, val_loss = self._pending
            self._pending = None
            self._judge(trainer, step, val_loss)
        trainer.summary.update(
            {"early_stopped": self.stopped, "best_step": self.best_step, "best_val_loss": self.best}
        )
        if self.best_step >= 0:
            trainer.summary["best_checkpoint"] = str(self.run_dir / f"checkpoints/step_{self.best_step:08d}")

    def _judge(self, trainer: Trainer, step: int, val_loss: float) -> None:
        val_loss = _agreed(val_loss, trainer.run.device)
        if not val_loss < self.best:  # NaN never improves
            self.bad += 1
            return
        self.best, self.best_step, self.bad = val_loss, step, 0
        if self._saved_step != step:
            checkpointing = next(cb for cb in trainer.callbacks if isinstance(cb, Checkpointing))
            checkpointing.save(trainer)
        if trainer.run.layout.is_main:
            write_best(self.run_dir, step, val_loss)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad, "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step = state["best"], state["best_step"]
        self.bad, self.stopped = state["bad"], state["stopped"]


def _agreed(value: float, device: torch.device) -> float:
    """Rank 0's ``value`` on every rank (one broadcast; a plain process: ``value``)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


class TaskEvaluation(Callback):
    """``[eval]``: the downstream tasks ``eval.tasks`` scored on the current weights every
    ``eval.interval`` steps and at the end (``evaluate/task_scoring.py``, as ``lmforge eval --tasks``
    scores a checkpoint): a record ``{"step", "task/<name>/<metric>": value, "..._stderr": se}`` per
    evaluation, and an event ``{"event": "task_regression", "task", "value", "best", "best_step",
    "threshold"}`` when a score falls below ``best - eval.regression_factor x se`` (``se`` the score's
    standard error, ``best`` the highest score so far, kept across a resume).

    The whole model is scored on rank 0 in every layout (``sample.py::whole_model``: gathered there under
    data, tensor and pipeline parallelism, every rank taking part), so a layout does not change a score;
    rank 0's record and events are then broadcast and logged on every rank, so the callbacks after this
    one (``BestTaskCheckpoint``) decide alike everywhere. Tasks are read when the callback is made, before
    any step; a loss task is refused (the validation loss is training's), and so is an ``eval.keep_best``
    that names none of the tasks."""

    state_key = "task_eval"

    def __init__(self, cfg: Config):
        self.cfg = cfg.eval
        self.tasks = resolve_tasks(",".join(self.cfg.tasks))
        for task in self.tasks:
            if task.kind == "loss":
                raise ConfigError(
                    f"eval.tasks: {task.name} is a loss task; training scores its validation loss, and "
                    "lmforge eval RUN --tasks scores loss tasks on checkpoints"
                )
            task.items = task.items[: self.cfg.limit or None]
        names = [task.name for task in self.tasks]
        if self.cfg.keep_best and self.cfg.keep_best not in names:
            raise ConfigError(
                f"eval.keep_best: {self.cfg.keep_best!r} is not a task of eval.tasks ({', '.join(names)}); "
                "name one of them"
            )
        self.best: dict[str, list[float]] = {}  # task -> [step, value]
        self._last_step = -1

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        interval, step = self.cfg.interval, trainer.progress.step
        if result.action is Action.STEP and interval and step % interval == 0 and step < trainer.total_steps:
            self.score(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        if self._last_step != trainer.progress.step:
            self.score(trainer)

    def score(self, trainer: Trainer) -> None:
        step = self._last_step = trainer.progress.step
        model = whole_model(trainer.run)  # None on every rank but 0 under several processes
        figures = None
        if model is not None:
            autocast = trainer.run.precision.autocast()
            tok, size = trainer.run.data.tokenizer, self.cfg.batch_size
            figures = {t.name: score_text_task(t, model, tok, size, autocast) for t in self.tasks}
        del model
        figures = _from_rank0(figures)
        record: dict = {"step": step}
        events = []
        for task in self.tasks:
            r = figures[task.name]
            key = f"task/{task.name}/{task.metric}"
            record[key], record[f"{key}_stderr"] = r["value"], r["stderr"]
            best = self.best.get(task.name)
            threshold = None if best is None else best[1] - self.cfg.regression_factor * r["stderr"]
            if threshold is not None and r["value"] < threshold:
                events.append(
                    {"event": "task_regression", "step": step, "task": task.name, "metric": task.metric,
                     "value": r["value"], "best": best[1], "best_step": int(best[0]), "threshold": threshold}
                )  # fmt: skip
            if best is None or r["value"] > best[1]:
                self.best[task.name] = [step, r["value"]]
        trainer.log(record)
        log.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
        for event in events:
            log.warning(
                "task regression at step %d: %s %s %.4f < %.4f (best %.4f at step %d minus %.1f standard errors)",
                step, event["task"], event["metric"], event["value"], event["threshold"], event["best"],
                event["best_step"], self.cfg.regression_factor,
            )  # fmt: skip
            trainer.log(event)

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = {k: list(v) for k, v in state.get("best", {}).items()}


def _from_rank0(value):
    """Rank 0's picklable ``value`` on every rank (one object broadcast; a plain process: ``value``)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class BestTaskCheckpoint(Callback):
    """``eval.keep_best = TASK``: the checkpoint of the step with ``TASK``'s highest score so far (a new
    best is strictly higher, so the first of equal scores is kept) exists and is named in
    ``RUN/best_task.json``, which checkpoint rotation never removes (``train/checkpoint.py::prune``); the
    summary gets ``best_task_step``, ``best_task_value`` and ``best_task_checkpoint``. The scores are
    :class:`TaskEvaluation`'s records, the same on every rank, so every rank takes part in the same saves.
    Place it after ``TaskEvaluation`` and ``Checkpointing``: a step the interval checkpoint already wrote is
    not written twice, and the final score is judged after the final checkpoint."""

    state_key = "best_task"

    def __init__(self, run_dir: Path, task: str):
        self.run_dir, self.task = Path(run_dir), task
        self.best = -math.inf
        self.best_step = -1
        self.metric = ""
        self._pending: tuple[int, str, float] | None = None  # (step, metric, value) logged during this hook
        self._saved_step = -1  # step of the newest checkpoint written

    def on_log(self, trainer: Trainer, record: dict) -> None:
        if "event" in record:
            return
        prefix = f"task/{self.task}/"
        for key, value in record.items():
            if key.startswith(prefix) and not key.endswith("_stderr"):
                self._pending = (record["step"], key[len(prefix) :], value)

    def on_checkpoint(self, trainer: Trainer, state: dict) -> None:
        self._saved_step = state["progress"]["step"]

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._judge(trainer)

    def on_train_end(self, trainer: Trainer) -> None:
        self._judge(trainer)  # the final score (the final checkpoint is already written)
        if self.best_step >= 0:
            trainer.summary.update(
                {
                    "best_task_step": self.best_step,
                    "best_task_value": self.best,
                    "best_task_checkpoint": str(self.run_dir / f"checkpoints/step_{self.best_step:08d}"),
                }
            )

    def _judge(self, trainer: Trainer) -> None:
        if self._pending is None:
            return
        (step, metric, value), self._pending = self._pending, None
        if not value > self.best:
            return
        self.best, self.best_step, self.metric = value, step, metric
        if self._saved_step != step:
            checkpointing = next(cb for cb in trainer.callbacks if isinstance(cb, Checkpointing))
            checkpointing.save(trainer)
        if trainer.run.layout.is_main:
            write_best_task(self.run_dir, self.task, metric, step, value)
            log.info("best %s %s %.4f at step %d: checkpoint kept", self.task, metric, value, step)

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "metric": self.metric}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.best_step, self.metric = state["best"], state["best_step"], state["metric"]
