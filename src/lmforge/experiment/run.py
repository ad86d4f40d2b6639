"""The experiment's runs: each arm and seed an ordinary ``lmforge train`` run (``train/launch.py::train``)
in its own folder, in the plan's interleaved order, so that a machine's changing load falls on every arm
alike. Resumable: a run with a ``summary.json`` is finished and not run again; a run with a checkpoint
before its last step continues from it; any other folder (a run killed before its first checkpoint)
starts afresh."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from lmforge.experiment.plan import PLAN_FILE, Plan
from lmforge.train.checkpoint import latest_checkpoint
from lmforge.train.launch import train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    """One run of the experiment as this call met it: ``status`` is ``ran``, ``resumed``, ``skipped``
    (finished before) or ``stopped`` (by a signal, named in ``reason``: the experiment stops after it)."""

    arm: str
    seed: int
    run_dir: Path
    status: str
    seconds: float
    reason: str | None = None


def write_plan(plan: Plan) -> None:
    """``OUT/experiment.json``: what the folder holds (recipe, overrides, arms, seeds, metrics)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    body = {
        **plan.identity(),
        "seeds": plan.seeds,
        "metrics": plan.metrics,
        "target": plan.target,
        "arms": [{"label": a.label, "overrides": a.overrides} for a in plan.arms],
    }
    (plan.out / PLAN_FILE).write_text(json.dumps(body, indent=1) + "\n")


def _resumable(run_dir: Path, steps: int) -> bool:
    """A checkpoint before the last step to continue from (a run killed after its last checkpoint but
    before its summary has nothing left to train, and no summary: it runs again)."""
    ckpt = latest_checkpoint(run_dir)
    return ckpt is not None and int(ckpt.name.removeprefix("step_")) < steps


def run_experiment(plan: Plan) -> list[RunRecord]:
    """Every run of ``plan`` in its order (finished ones skipped); the records in the order met. Stops
    after a run that a signal stopped (resumably: the same command continues it)."""
    write_plan(plan)
    records: list[RunRecord] = []
    total = len(plan.arms) * len(plan.seeds)
    for i, (arm, seed) in enumerate(plan.order(), 1):
        run_dir = plan.run_dir(arm, seed)
        if (run_dir / "summary.json").is_file():
            records.append(RunRecord(arm.label, seed, run_dir, "skipped", 0.0))
            continue
        cfg = plan.config(arm, seed)
        resume = _resumable(run_dir, cfg.train.steps)
        if run_dir.exists() and not resume:  # nothing to continue: start afresh
            shutil.rmtree(run_dir)
        log.info("run %d/%d: %s seed %d%s", i, total, arm.label, seed, " (resumed)" if resume else "")
        t0 = time.perf_counter()
        summary = train(cfg, run_dir, resume=resume, progress_bar=False)
        status = "stopped" if summary.get("stopped") else "resumed" if resume else "ran"
        elapsed = time.perf_counter() - t0
        records.append(RunRecord(arm.label, seed, run_dir, status, elapsed, summary.get("reason")))
        if status == "stopped":
            break
    return records
