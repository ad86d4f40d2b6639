"""``lmforge train``: a run folder, the run built from the config, the trainer with its callbacks."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from lmforge.config import Config
from lmforge.errors import ConfigError, UserError
from lmforge.recipe import migrate_moved, to_toml
from lmforge.train.build import build_run, validate
from lmforge.train.callbacks.base import Callback
from lmforge.train.callbacks.checkpointing import Checkpointing, config_state
from lmforge.train.callbacks.evaluation import Evaluation
from lmforge.train.callbacks.guard import StabilityGuard
from lmforge.train.callbacks.metrics import MetricsFile, ProgressBarCallback, StepMetrics
from lmforge.train.callbacks.sample import Sample
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint, remove_partial
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def check_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a new run); user errors for a wrong ``--resume``."""
    remove_partial(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if resume and ckpt is None:
        raise UserError(f"--resume: no complete checkpoint in {run_dir}/checkpoints; run without --resume")
    if not resume and ckpt is not None:
        raise UserError(
            f"--run-dir: {run_dir} already holds checkpoints; pass --resume or choose a new --run-dir"
        )
    return ckpt


def check_same_model(cfg: Config, saved_cfg: dict) -> None:
    """A resume may change anything but the learned function's definition: ``model.*`` must match."""
    saved = migrate_moved(saved_cfg).get("model", {})  # a run saved before a key moved out of model.*
    now = config_state(cfg)["model"]
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            raise ConfigError(
                f"model.{key}: checkpoint has {saved.get(key)!r}, config has {now.get(key)!r}; "
                "resume with the same model settings"
            )


def default_callbacks(cfg: Config, run_dir: Path, progress_bar: bool | None) -> list[Callback]:
    """The callbacks of every training run, in the order they are called."""
    return [
        StabilityGuard(cfg.guard),
        StepMetrics(),
        Evaluation(),
        Checkpointing(run_dir, to_toml(cfg)),
        Sample(),
        MetricsFile(run_dir),
        ProgressBarCallback(progress_bar),
    ]


def train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress_bar: bool | None = None,
) -> dict:
    """Run (or resume) training as configured; returns the summary also written to ``summary.json``.

    ``callbacks`` run after the default ones (evaluation, checkpoints, metrics, guard, sample, progress).
    A run stopped early by a callback (``trainer.request_stop()``) returns ``{"step": N, "stopped":
    True}`` after its checkpoint and writes no summary.
    """
    run_dir = Path(run_dir)
    validate(cfg)
    ckpt_path = check_run_dir(run_dir, resume)
    state = load_checkpoint(ckpt_path) if ckpt_path is not None else None
    if state is not None:
        check_same_model(cfg, state["config"])
    run = build_run(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    shutil.copyfile(run.data.tokenizer.path, run_dir / "tokenizer.json")
    trainer = Trainer(run, [*default_callbacks(cfg, run_dir, progress_bar), *callbacks])
    if state is not None:
        trainer.load_state_dict(state)
        log.info("resumed from %s at step %d", ckpt_path, trainer.progress.step)
    trainer.fit()
    if trainer.stop_requested:
        return {"step": trainer.progress.step, "stopped": True}
    summary = {
        "step": trainer.progress.step,
        **trainer.summary,
        "tokens_seen": trainer.progress.tokens_seen,
        "wall_time_s": trainer.progress.elapsed_s,
        "parameters": run.model.num_params(False),
        "precision": run.precision.name,
    }
    domains = run.loader.summary()
    if domains:
        summary["domains"] = domains
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
