"""Resuming a run continues the run that was started.

* The base of a resumed run's config is the run's own ``config.toml`` (a recipe given with ``--config``
  and ``--SECTION.KEY=VALUE`` flags are laid over it), never the built-in defaults.
* Every key that differs from the config the checkpoint was trained with is a *change*. A change that
  cannot continue the run (:func:`fixed_reason`: the model, the data stream and tokenizer, the seed, the
  optimizer's kind) stops with one line naming the key; the others are logged, and the learning rate at
  the resume step is shown before and after when they move it.
* The global batch (tokens per optimizer step over every data-parallel rank) is part of the run: a resume
  that does not set ``train.tokens_per_step`` keeps the checkpoint's (:func:`keep_global_batch`), the
  gradient accumulation absorbing another process count or micro-batch size, and is refused when it
  cannot be kept exactly; changing it is an explicit ``--train.tokens_per_step``, logged with what it
  means for the learning rate (lmforge leaves it as it is).
* Extending a run is explicit: ``--train.steps`` larger than the checkpoint's step (a finished run
  resumed without it says so); a smaller one is refused.
* ``config.toml`` keeps the history: one comment line ``# step N: KEY OLD -> NEW`` per change, above the
  settings, so the file still loads as a recipe.
"""

from __future__ import annotations

import json
import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import Config
from lmforge.errors import ConfigError, UserError
from lmforge.optim.schedules import Schedule
from lmforge.recipe import build_config, deep_merge, migrate_moved, read_recipe, to_toml
from lmforge.train.callbacks.checkpointing import config_state

log = logging.getLogger(__name__)

HISTORY_HEADER = "# changes made when this run was resumed (lmforge train --resume):"
_HISTORY_PREFIX = "# step "

# Keys a resume must not change, by dotted prefix, with what they define. Everything else may change.
FIXED: dict[str, str] = {
    "model.": "the model's shape and parametrisation",
    "data.": "the token stream (inputs, tokenizer, split, sequence length, mixture)",
    "train.seed": "the data order and random state",
    "optim.name": "the kind of optimizer state in the checkpoint",
    "lora.": "which parameters exist and train (adapters, their rank, the quantised base)",
}
MOVABLE = {"data.cache_dir"}  # where prepared data lives, not what it is


@dataclass(frozen=True)
class Change:
    """One key that differs between the checkpoint's config and the resumed run's."""

    key: str
    old: Any
    new: Any

    def line(self, step: int) -> str:
        return f"{_HISTORY_PREFIX}{step}: {self.key} {json.dumps(self.old)} -> {json.dumps(self.new)}"


def fixed_reason(key: str) -> str | None:
    """What ``key`` defines when a resume may not change it, else None."""
    if key in MOVABLE:
        return None
    for prefix, what in FIXED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return what
    return None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists (of tables too) stay whole values, empty tables vanish."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def global_batch(tree: dict[str, Any]) -> int:
    """Tokens per optimizer step over all data-parallel ranks of a config tree (a checkpoint's
    ``config_state``): its ``train.tokens_per_step``, by default one micro-batch per data-parallel rank."""
    t, d, p = (tree.get(k, {}) for k in ("train", "data", "parallel"))
    if t.get("tokens_per_step") is not None:
        return int(t["tokens_per_step"])
    default = Config()
    dp = p.get("dp_replicate", 1) * p.get("dp_shard", 1)
    micro = t.get("micro_batch_size", default.train.micro_batch_size)
    return int(micro) * int(d.get("seq_len", default.data.seq_len)) * dp


def _with_global_batch(tree: dict[str, Any]) -> dict[str, Any]:
    return {**tree, "train": {**tree.get("train", {}), "tokens_per_step": global_batch(tree)}}


def keep_global_batch(cfg: Config, saved: dict[str, Any]) -> Config:
    """``cfg`` resuming a checkpoint trained with the config ``saved``: without ``train.tokens_per_step``
    it keeps the checkpoint's global batch, the accumulation ``tokens / (micro_batch_size x seq_len x dp)``
    absorbing another process count or micro-batch size; a ConfigError when that is not a whole number."""
    t = cfg.train
    if t.tokens_per_step is not None or t.micro_batch_size == "auto":  # given: the run's own check
        return cfg
    tokens = global_batch(migrate_moved(saved))
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    per = t.micro_batch_size * cfg.data.seq_len * dp
    if tokens % per:
        raise ConfigError(
            f"train.tokens_per_step: the run was trained with {tokens:,} tokens per step, which {dp} data-"
            f"parallel rank(s) of micro_batch_size x seq_len = {t.micro_batch_size} x {cfg.data.seq_len} "
            f"cannot split into whole micro-batches; resume with a --train.micro_batch_size or process count "
            f"that divides it, or change the global batch explicitly with --train.tokens_per_step=N"
        )
    return cfg.model_copy(update={"train": t.model_copy(update={"tokens_per_step": tokens})})


def config_changes(saved: dict[str, Any], cfg: Config) -> list[Change]:
    """Keys whose value in ``cfg`` differs from ``saved`` (a checkpoint's ``config_state``), sorted; the
    global batch compared as tokens per step (an unset ``train.tokens_per_step`` is its default)."""
    old = flatten(_with_global_batch(migrate_moved(saved)))
    new = flatten(_with_global_batch(config_state(cfg)))
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return [Change(k, old.get(k), new.get(k)) for k in keys]


def check_changes(changes: list[Change], step: int, total_steps: int) -> None:
    """ConfigError for the first change that cannot continue the run; UserError when nothing is left."""
    for c in changes:
        what = fixed_reason(c.key)
        if what is not None:
            raise ConfigError(
                f"{c.key}: the checkpoint was trained with {json.dumps(c.old)}, not {json.dumps(c.new)}; "
                f"it defines {what}, so the run cannot continue with another value (start a new --run-dir)"
            )
    if total_steps < step:
        raise ConfigError(
            f"train.steps: {total_steps} is below the checkpoint's step {step}; "
            f"give --train.steps={step} or more (or start a new --run-dir)"
        )
    if total_steps == step:
        raise UserError(
            f"--resume: the run already finished its train.steps = {step}; to train on, extend it "
            f"explicitly with --train.steps=N (N > {step})"
        )


def lr_at(cfg: Config, step: int, schedule_state: dict | None = None) -> float:
    """The learning rate ``cfg`` gives at ``step`` (``optim.lr * schedule(step)``)."""
    schedule = Schedule(cfg.schedule, cfg.train.steps)
    if schedule_state:
        schedule.load_state_dict(schedule_state)
    return cfg.optim.lr * schedule(step)


def report_changes(changes: list[Change], saved: dict[str, Any], cfg: Config, state: dict) -> None:
    """Log each change, and the learning rate at the resume step before and after when it moved."""
    step = state["progress"]["step"]
    for c in changes:
        log.info("resume at step %d: %s %s -> %s", step, c.key, json.dumps(c.old), json.dumps(c.new))
        if c.key == "train.tokens_per_step":
            log.warning(batch_change_note(step, c.old, c.new))
    keys = {c.key for c in changes}
    if keys & BATCH_SHAPE and "train.tokens_per_step" not in keys and cfg.train.micro_batch_size != "auto":
        log.info(kept_batch_note(cfg, step))
    if not changes:
        return
    try:
        before = lr_at(build_config(migrate_moved(saved)), step, state.get("scheduler"))
    except UserError:  # a checkpoint written by an older lmforge whose config no longer validates
        return
    after = lr_at(cfg, step, state.get("scheduler"))
    if before != after:
        rise = after > 2 * before
        (log.warning if rise else log.info)(
            "resume at step %d: the learning rate goes from %.3g to %.3g with these changes%s",
            step,
            before,
            after,
            " (a jump up; to extend a decayed run, resume from a checkpoint before its decay)"
            if rise
            else "",
        )


BATCH_SHAPE = {"train.micro_batch_size", "parallel.dp_replicate", "parallel.dp_shard"}


def kept_batch_note(cfg: Config, step: int) -> str:
    """The global batch a resume keeps, and the accumulation that keeps it."""
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    tokens, micro, seq = global_batch(config_state(cfg)), cfg.train.micro_batch_size, cfg.data.seq_len
    return (
        f"resume at step {step}: the global batch stays {tokens:,} tokens per step: "
        f"{tokens // (micro * seq * dp)} micro-batch(es) of {micro} x {seq} a step on each of {dp} "
        "data-parallel rank(s)"
    )


def batch_change_note(step: int, old: int, new: int) -> str:
    """What an explicit change of the global batch does to the learning rate (nothing) and the rules a
    user may apply by hand."""
    r = new / old
    return (
        f"resume at step {step}: the global batch goes from {old:,} to {new:,} tokens per step (x{r:.3g}); "
        f"lmforge keeps optim.lr and its schedule as they are. To keep the update size, scale optim.lr "
        f"yourself: x{r:.3g} by the linear rule (SGD, small batches), x{r**0.5:.3g} by the square-root rule "
        f"(Adam-type optimizers)"
    )


# -- config.toml with its history -------------------------------------------------------------------


def read_history(path: Path) -> list[str]:
    """The ``# step N: ...`` lines of a run's ``config.toml`` (none when it has no history)."""
    if not path.is_file():
        return []
    return [ln for ln in path.read_text().splitlines() if ln.startswith(_HISTORY_PREFIX)]


def config_text(cfg: Config, history: list[str]) -> str:
    """``config.toml``: the history comment block (when there is one), then the resolved settings."""
    head = [HISTORY_HEADER, *history, ""] if history else []
    return "\n".join(head) + to_toml(cfg)


# -- the resumed run's config ------------------------------------------------------------------------


def resume_config(run_dir: Path, recipe: str | None, overrides: dict[str, Any]) -> Config:
    """The resumed run's config: ``run_dir/config.toml`` <- ``recipe`` (if given) <- ``overrides``."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise UserError(
            f"--resume: {path} is missing; give the --run-dir of an lmforge run (it holds config.toml)"
        )
    try:
        base = migrate_moved(tomllib.loads(path.read_text()))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(
            f"--resume: {path} is not valid TOML ({exc}); restore the run's config.toml"
        ) from None
    top = read_recipe(recipe, overrides, "the path of a TOML recipe (see configs/)")
    return build_config(deep_merge(base, top))
