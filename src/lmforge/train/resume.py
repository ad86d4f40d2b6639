"""Resuming a run continues the run that was started.

* The base of a resumed run's config is the run's own ``config.toml`` (a recipe given with ``--config``
  and ``--SECTION.KEY=VALUE`` flags are laid over it), never the built-in defaults.
* Every key that differs from the config the checkpoint was trained with is a *change*. A change that
  cannot continue the run (:func:`fixed_reason`: the model, the data stream and tokenizer, the seed, the
  optimizer's kind) stops with one line naming the key; the others are logged, and the learning rate at
  the resume step is shown before and after when they move it.
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


def config_changes(saved: dict[str, Any], cfg: Config) -> list[Change]:
    """Keys whose value in ``cfg`` differs from ``saved`` (a checkpoint's ``config_state``), sorted."""
    old = flatten(migrate_moved(saved))
    new = flatten(config_state(cfg))
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
