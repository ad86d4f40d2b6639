"""``lmforge lr-find``: run the learning-rate sweep of ``lmforge/plan/lr_finder.py`` on a recipe.

The run is built by the training build path (``train/build.py``): the recipe's model, optimizer (with
its parameter groups and multipliers, muP's included), training loader (mixture and phases included),
micro-batching, clipping mode and precision are those of training; only the learning rate differs: step
``i`` runs at ``sweep_lr(i)`` instead of the schedule. Nothing is written but the two outputs
(``lr_find.json``, ``lr_find.png``): no run folder, no checkpoint, no metrics. Prepared data goes to the
recipe's data cache as for training (and is reused from there).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lmforge.config import Config, LRFindConfig
from lmforge.data.loader import Batch
from lmforge.errors import UserError
from lmforge.optim.clip import Clipper
from lmforge.plan.lr_finder import Suggestion, diverged, smooth, suggest, sweep_lr
from lmforge.precision import PrecisionPolicy
from lmforge.report.charts import lr_find_chart
from lmforge.train.build import Run, build_run
from lmforge.train.modules import TrainModule
from lmforge.train.runtime import rng_state, set_rng_state
from lmforge.train.step import train_step

log = logging.getLogger(__name__)


@dataclass
class LRFindResult:
    lrs: list[float]  # learning rate of each completed step
    losses: list[float]  # its training loss (finite)
    smoothed: list[float]  # bias-corrected EMA of the losses
    suggestion: Suggestion
    stopped_early: bool  # the sweep diverged before end_lr
    stop_lr: float | None  # learning rate of the step that diverged

    def to_json(self) -> dict:
        out = asdict(self)
        out["rule"] = (
            "steepest negative slope of the smoothed loss against log(lr), before its minimum; "
            "min_over_10: learning rate at the smoothed minimum / 10"
        )
        return out


def range_test(
    module: TrainModule,
    optimizer: torch.optim.Optimizer,
    next_batches: Callable[[], list[Batch]],
    f: LRFindConfig,
    clipper: Clipper,
    precision: PrecisionPolicy,
) -> LRFindResult:
    """Train ``f.steps`` steps at geometrically growing learning rates on ``next_batches()`` (one list of
    micro-batches per step) through the training module ``module``; stop on divergence. Its model, the
    ``optimizer`` and ``clipper`` are put back as they were (parameters, buffers, optimizer state and
    learning rates, clipping statistics, the loss scale, random generators), so a live run can be probed."""
    model = module.model
    model_state = copy.deepcopy(model.state_dict())
    optim_state = copy.deepcopy(optimizer.state_dict())
    clip_state = copy.deepcopy(clipper.state_dict())
    precision_state = copy.deepcopy(precision.state_dict())  # fp16: the loss scale the sweep moves
    rng = rng_state()
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    stop_lr = None
    try:
        for i in range(f.steps):
            lr = sweep_lr(i, f.steps, f.start_lr, f.end_lr)
            out = train_step(module, optimizer, next_batches(), lr, clipper, precision)
            loss = float(out.loss)
            if not math.isfinite(loss):
                stop_lr = lr
                break
            lrs.append(lr)
            losses.append(loss)
            smoothed = smooth(losses, f.smoothing)
            log.info("lr-find: step %d lr %.3g loss %.4f smoothed %.4f", i, lr, loss, smoothed[-1])
            if diverged(loss, smoothed, f.diverge_factor):
                stop_lr = lr
                break
    finally:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        optimizer.zero_grad(set_to_none=True)
        clipper.load_state_dict(clip_state)
        precision.load_state_dict(precision_state)
        set_rng_state(rng)
    if len(lrs) < 3:
        raise UserError(
            f"lr_find.start_lr: the loss diverged after {len(lrs)} steps at {f.start_lr:g}; lower it"
        )
    return LRFindResult(lrs, losses, smoothed, suggest(lrs, smoothed), stop_lr is not None, stop_lr)


def sweep(cfg: Config) -> LRFindResult:
    """:func:`sweep_run` on the run that ``lmforge train`` would build from the recipe."""
    return sweep_run(build_run(cfg), cfg.lr_find)


def sweep_run(run: Run, f: LRFindConfig) -> LRFindResult:
    """:func:`range_test` on a built run: its training module, optimizer, loader, clipper, precision."""
    return range_test(
        run.module,
        run.optimizer,
        lambda: [run.loader.next_batch() for _ in range(run.accum)],
        f,
        run.clipper,
        run.precision,
    )


def _replace_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def run_lr_find(cfg: Config, out_dir: Path) -> LRFindResult:
    """:func:`sweep`, then ``out_dir/lr_find.json`` (the curve and suggestion) and ``lr_find.png``."""
    result = sweep(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    _replace_write(
        out_dir / "lr_find.json", lambda p: p.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    )
    _replace_write(
        out_dir / "lr_find.png",
        lambda p: lr_find_chart(result.lrs, result.losses, result.smoothed, result.suggestion, p),
    )
    return result
