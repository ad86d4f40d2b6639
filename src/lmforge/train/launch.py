"""``lmforge train``: a run folder and its config (:func:`run_folder`), the run built from the config,
the trainer with its callbacks (:func:`train`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from lmforge.config import Config
from lmforge.data.preflight import preflight
from lmforge.errors import UserError
from lmforge.parallel.layout import close_layout, launch_env
from lmforge.recipe import load_config
from lmforge.train.build import Run, build_run, validate
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.checkpointing import Checkpointing
from lmforge.train.callbacks.control import QATSwitch, StopOnSignal
from lmforge.train.callbacks.detail import DetailMetrics
from lmforge.train.callbacks.evaluation import BestTaskCheckpoint, EarlyStopping, Evaluation, TaskEvaluation
from lmforge.train.callbacks.guard import StabilityGuard
from lmforge.train.callbacks.metrics import StepMetrics
from lmforge.train.callbacks.profile import Profile
from lmforge.train.callbacks.sample import Sample
from lmforge.train.callbacks.sinks import Console, MetricsFile, WandbSink, require_wandb
from lmforge.train.checkpoint import (
    latest_checkpoint,
    load_training_state,
    newest_valid_checkpoint,
    read_trainer_state,
    remove_partial,
)
from lmforge.train.resume import (
    check_changes,
    config_changes,
    config_text,
    keep_global_batch,
    read_history,
    report_changes,
    resume_config,
)
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def newest_run(runs: Path) -> Path | None:
    """The run folder under ``runs`` written last (None: there is none)."""
    found = sorted(
        (p for p in runs.glob("*") if (p / "config.toml").is_file()), key=lambda p: p.stat().st_mtime
    )
    return found[-1] if found else None


def run_folder(
    recipe: str | None, run_dir: str | None, resume: bool, overrides: dict
) -> tuple[Config, Path, bool]:
    """``lmforge train``'s ``(config, run folder, resume)``. The folder: ``run_dir`` (required under
    ``torchrun``, so every process and every restart uses the same one), else with ``resume`` the newest
    run under ``runs/``, else ``runs/<timestamp>``. A job ``torchrun`` restarted resumes from its newest
    complete checkpoint. The config: resumed, the run's own ``config.toml`` under ``recipe`` and
    ``overrides`` (``train/resume.py``); new, ``recipe`` under ``overrides``."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if "WORLD_SIZE" in os.environ and not run_dir:
        raise UserError(
            "--run-dir: required under torchrun, so that every process (and every restart) uses the same "
            "folder; pass --run-dir runs/NAME"
        )
    if run_dir:
        folder = Path(run_dir)
    elif resume:
        found = newest_run(Path("runs"))
        if found is None:
            raise UserError("--resume: no run under runs/; pass --run-dir DIR of the run to continue")
        folder = found
    else:
        folder = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if restarted and latest_checkpoint(folder) is not None:  # torchrun brought the job back: continue it
        log.warning(
            "torchrun restart %s: resuming from the newest complete checkpoint",
            os.environ["TORCHELASTIC_RESTART_COUNT"],
        )
        resume = True
    if resume:  # the run's own config.toml is the base; the recipe and flags change it
        return resume_config(folder, recipe, overrides), folder, True
    return load_config(recipe, overrides), folder, False


def refuse_inside_a_run(run_dir: Path) -> None:
    """A UserError when ``run_dir`` lies inside another run's folder (a folder above it holding
    ``config.toml`` and ``checkpoints/`` or ``metrics.jsonl``): its files would mix with that run's."""
    for parent in Path(run_dir).resolve().parents:
        if (parent / "config.toml").is_file() and (
            (parent / "checkpoints").is_dir() or (parent / "metrics.jsonl").is_file()
        ):
            raise UserError(
                f"--run-dir: {run_dir} lies inside the run folder {parent}; choose a folder outside any run "
                "(e.g. runs/NAME)"
            )


def check_run_dir(run_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None for a new run); user errors for a run folder inside another
    run's, for a wrong ``--resume`` and for a new run in a folder that already holds another run's
    checkpoints or metrics."""
    refuse_inside_a_run(run_dir)
    if launch_env()[0] == 0:
        remove_partial(run_dir)
    ckpt = latest_checkpoint(run_dir)
    if resume and ckpt is not None:  # the newest whose files match its manifest; damaged ones are skipped
        ckpt = newest_valid_checkpoint(run_dir)
    if resume and ckpt is None:
        if list(run_dir.glob("checkpoints/step_*/state.pt")):
            raise UserError(
                f"--resume: {run_dir}/checkpoints holds checkpoints of an earlier lmforge (state.pt) that this "
                "version does not read (checkpoints are sharded DCP folders now); start a new --run-dir"
            )
        raise UserError(f"--resume: no complete checkpoint in {run_dir}/checkpoints; run without --resume")
    if not resume and ckpt is not None:
        raise UserError(
            f"--run-dir: {run_dir} already holds checkpoints; pass --resume or choose a new --run-dir"
        )
    if not resume and ((run_dir / "metrics.jsonl").exists() or (run_dir / "tensorboard").exists()):
        raise UserError(
            f"--run-dir: {run_dir} holds the metrics of an earlier run (metrics.jsonl, tensorboard/) but no "
            "checkpoint to resume; choose a new --run-dir or delete that folder"
        )
    return ckpt


def default_callbacks(
    cfg: Config, run_dir: Path, progress_bar: bool | None, config_toml: str, main: bool = True
) -> list[Callback]:
    """The callbacks of every training run, in the order they are called (the metrics file and the
    console only on the main process; every rank takes part in the others' collectives)."""
    t = cfg.train
    sinks = [MetricsFile(run_dir), Console(progress_bar)] if main else []
    sinks += [WandbSink(run_dir, cfg)] if main and cfg.metrics.wandb else []
    return [
        *([QATSwitch(cfg.qat.start_step)] if cfg.qat.enabled else []),
        StopOnSignal(),
        StabilityGuard(cfg.guard),
        StepMetrics(),
        DetailMetrics(),
        Evaluation(),
        *([TaskEvaluation(cfg)] if cfg.eval.tasks else []),
        Checkpointing(run_dir, config_toml),
        *([EarlyStopping(run_dir, t.early_stop_patience)] if t.early_stop_patience else []),
        *([BestTaskCheckpoint(run_dir, cfg.eval.keep_best)] if cfg.eval.keep_best else []),
        *([Profile(run_dir, *t.profile_steps)] if t.profile_steps else []),
        Sample(),
        *sinks,
    ]


def train(
    cfg: Config,
    run_dir: Path,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    progress_bar: bool | None = None,
) -> dict:
    """Run (or resume) training as configured; returns the summary also written to ``summary.json``.

    ``callbacks`` run after the default ones (signals, guard, metrics, evaluation, checkpoints, sample,
    console). A run stopped early (a signal, or a callback's ``trainer.request_stop(reason)``) returns
    ``{"step": N, "stopped": True, "reason": ..., "checkpoint": PATH}`` after its checkpoint and writes no
    summary. With ``resume``, ``cfg`` is checked against the checkpoint's config (``train/resume.py``).
    """
    run_dir = Path(run_dir)
    validate(cfg)
    if cfg.eval.tasks:
        TaskEvaluation(cfg)  # the task files read and checked before any work
    if cfg.metrics.wandb:
        require_wandb()
    ckpt_path = check_run_dir(run_dir, resume)
    state = read_trainer_state(ckpt_path) if ckpt_path is not None else None
    history: list[str] = []
    if state is not None:
        step = state["progress"]["step"]
        cfg = keep_global_batch(cfg, state["config"])
        changes = config_changes(state["config"], cfg)
        check_changes(changes, step, cfg.train.steps)
        report_changes(changes, state["config"], cfg, state)
        history = read_history(run_dir / "config.toml") + [c.line(step) for c in changes]
    run = build_run(cfg, run_dir=run_dir)
    layout = run.layout
    try:
        out = _train(run, run_dir, ckpt_path, history, callbacks, progress_bar)
    except BaseException:
        close_layout(layout, finished=False)
        raise
    del run  # the modules that use the process groups go before the groups (close_layout)
    close_layout(layout)
    return out


def _train(
    run: Run,
    run_dir: Path,
    ckpt_path: Path | None,
    history: list[str],
    callbacks: Sequence[Callback],
    progress_bar: bool | None,
) -> dict:
    cfg, main = run.cfg, run.layout.is_main
    if main and run.val is not None:  # a token stream's data (lm): the preflight's summary
        preflight(cfg, run.data, run.tokens_per_step)
    config_toml = config_text(cfg, history)
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_toml)
        if run.data.tokenizer.path.resolve() != (run_dir / "tokenizer.json").resolve():
            shutil.copyfile(run.data.tokenizer.path, run_dir / "tokenizer.json")
    defaults = default_callbacks(cfg, run_dir, progress_bar, config_toml, main)
    trainer = Trainer(run, [*defaults, *callbacks])
    if ckpt_path is not None:
        trainer.load_state_dict(load_training_state(ckpt_path, run.model, run.optimizer))
        log.info("resumed from %s at step %d", ckpt_path, trainer.progress.step)
    trainer.fit()
    if trainer.stop_requested:
        ckpt = latest_checkpoint(run_dir)
        return {
            "step": trainer.progress.step,
            "stopped": True,
            "reason": trainer.stop_reason,
            "checkpoint": str(ckpt),
        }
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
    if run.layout.distributed:
        summary["layout"] = run.layout.describe()
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
