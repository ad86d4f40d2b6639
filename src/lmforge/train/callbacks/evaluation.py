"""Periodic and final evaluation on the validation stream, and the summary's loss figures."""

from __future__ import annotations

from lmforge.data.loader import eval_batches
from lmforge.train.callbacks.base import Callback
from lmforge.train.evaluate import eval_targets, perplexity, unigram_loss
from lmforge.train.posttrain import posttrain_validation
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
        if run.cfg.train.objective != "lm":  # held-out records: no unigram baseline of a token stream
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
        if run.cfg.train.objective == "lm":
            val_loss, self._extra = validation_loss(trainer), {}
        else:
            val_loss, self._extra = posttrain_validation(run.cfg, run.data, run.module, run.precision)
        if val_loss is None:  # no held-out records
            return None
        step = trainer.progress.step
        self._last = (step, val_loss)
        record = {"step": step, "val_loss": val_loss, **self._extra}
        if run.cfg.train.objective != "dpo":  # a DPO loss is no per-token likelihood
            record["val_ppl"] = perplexity(val_loss)
        trainer.log(record)  # Console shows it
        return val_loss
