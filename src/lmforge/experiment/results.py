"""The experiment's results, read back from its finished run folders: each metric per run, per arm its
mean, sample standard deviation and n, and against the first (baseline) arm the difference and Welch's
t-test (``stats.py``); written as ``results.json``, ``results.md`` and ``experiment.png``.

The metrics (:data:`plan.METRICS`): the validation loss at equal tokens (each run's evaluation curve,
interpolated linearly in tokens, read at the fewest tokens any run trained on: the final loss when every
run trains as many tokens), the steps and the tokens to a target validation loss (by default the baseline
arm's mean ``val_loss``; linear interpolation between the two evaluations that straddle it; a run that
never reaches it counts as not reached and is left out of n) and the training wall clock."""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import UserError
from lmforge.experiment.plan import METRICS, Plan
from lmforge.experiment.stats import mean, sample_sd, welch_test
from lmforge.report.charts import experiment_chart
from lmforge.report.runs import open_run


@dataclass
class RunData:
    """One finished run: its validation curve ``(step, loss)``, tokens trained at each logged step
    ``(step, tokens)`` and its ``summary.json``."""

    seed: int
    curve: list[tuple[int, float]]
    tokens: list[tuple[int, float]]
    summary: dict[str, Any]

    def tokens_at(self, step: float) -> float:
        """Tokens trained after (fractional) ``step``: linear between the logged steps."""
        steps, tokens = zip(*self.tokens, strict=True)
        return float(np.interp(step, steps, tokens))

    def loss_at_tokens(self, tokens: float) -> float:
        """The validation curve, linear in tokens, at ``tokens``."""
        xs = [self.tokens_at(s) for s, _ in self.curve]
        return float(np.interp(tokens, xs, [v for _, v in self.curve]))


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """First step at which the piecewise-linear curve through ``(step, loss)`` falls to ``target``.

    ``None`` when it never does; the first evaluated step when the curve starts at or below ``target``.
    """
    prev: tuple[int, float] | None = None
    for step, loss in curve:
        if loss <= target:
            if prev is None:
                return float(step)
            s0, l0 = prev
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
        prev = (step, loss)
    return None


def read_run(run_dir: Path, seed: int) -> RunData | None:
    """A finished run folder's data (None before its ``summary.json``)."""
    run = open_run(run_dir)
    if run.summary is None:
        return None
    steps, losses = run.series("eval", "val_loss")
    logged = dict(zip(*run.series("step", "tokens_seen"), strict=True))
    logged.update({0: 0.0, int(run.summary["step"]): float(run.summary["tokens_seen"])})
    return RunData(seed, list(zip(steps, losses, strict=True)), sorted(logged.items()), run.summary)


def read_runs(plan: Plan) -> dict[str, list[RunData]]:
    """Each arm's finished runs, in seed order."""
    out: dict[str, list[RunData]] = {}
    for arm in plan.arms:
        found = (read_run(plan.run_dir(arm, s), s) for s in plan.seeds)
        out[arm.label] = [r for r in found if r is not None]
    return out


def metric_values(
    runs: dict[str, list[RunData]], target: float | None
) -> tuple[dict[str, dict[str, list[float | None]]], float, float]:
    """``(values[metric][arm] per seed, equal tokens, target)``; None: the target was not reached."""
    every = [r for rs in runs.values() for r in rs]
    equal = min(float(r.summary["tokens_seen"]) for r in every)
    values: dict[str, dict[str, list[float | None]]] = {m: {} for m in METRICS}
    for label, rs in runs.items():
        values["val_loss"][label] = [r.loss_at_tokens(equal) for r in rs]
        values["wall_time"][label] = [float(r.summary["wall_time_s"]) for r in rs]
    if target is None:
        target = mean(values["val_loss"][next(iter(runs))])
    for label, rs in runs.items():
        steps = [steps_to_reach(r.curve, target) for r in rs]
        values["steps_to_target"][label] = steps
        values["tokens_to_target"][label] = [
            None if s is None else r.tokens_at(s) for r, s in zip(rs, steps, strict=True)
        ]
    return values, equal, target


def arm_stats(values: dict[str, list[float | None]]) -> dict[str, dict[str, Any]]:
    """Per arm: values, mean, sd, n (the values, not counting targets not reached), runs and, against the first arm, diff, t, df and p."""
    labels = list(values)
    kept = {k: [v for v in vs if v is not None] for k, vs in values.items()}
    base = kept[labels[0]]
    out = {}
    for label in labels:
        x = kept[label]
        row: dict[str, Any] = {"values": values[label], "mean": _num(mean(x)), "sd": _num(sample_sd(x))}
        row["n"], row["runs"] = len(x), len(values[label])
        if label != labels[0]:
            w = welch_test(base, x)
            row.update(diff=_num(w.diff), t=w.t, df=w.df, p=w.p)
        out[label] = row
    return out


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def hardware() -> dict[str, Any]:
    """The machine the runs trained on: CPU model, cores, torch threads, GPU."""
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if "model name" in ln]
        cpu = names[0] if names else cpu
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "gpu": gpu}


def summarize(plan: Plan, command: str = "") -> dict[str, Any]:
    """The results of ``plan``'s finished runs (see the module docstring)."""
    runs = read_runs(plan)
    missing = [f"{label} ({len(rs)}/{len(plan.seeds)})" for label, rs in runs.items() if not rs]
    if missing:
        raise UserError(f"{plan.out}: no finished run for arm {', '.join(missing)}; run the experiment first")
    values, equal, target = metric_values(runs, plan.target)
    every = [r for rs in runs.values() for r in rs]
    return {
        "command": command,
        **plan.identity(),
        "seeds": plan.seeds,
        "arms": list(runs),
        "baseline": next(iter(runs)),
        "finished_runs": {label: len(rs) for label, rs in runs.items()},
        "equal_tokens": equal,
        "target": target,
        "target_from": "--target" if plan.target is not None else "the baseline arm's mean val_loss",
        "steps": max(int(r.summary["step"]) for r in every),
        "train_time_s": sum(float(r.summary["wall_time_s"]) for r in every),
        "hardware": hardware(),
        "metrics": {m: {"about": METRICS[m], "arms": arm_stats(values[m])} for m in plan.metrics},
        "final_losses": values["val_loss"],
        "curves": {label: [r.curve for r in rs] for label, rs in runs.items()},
    }


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}" if abs(x) < 1e-3 or abs(x) >= 1e5 else f"{x:.{digits}f}"


def markdown(res: dict[str, Any]) -> str:
    """``results.md``: what ran, on what, and one table per metric."""
    hw = res["hardware"]
    lines = [
        f"# Experiment: {res['recipe'] or 'the defaults'}, varying {', '.join(res['vary'])}",
        "",
        f"- command: `{res['command']}`" if res["command"] else "- command: (library call)",
        f"- arms: {', '.join(res['arms'])} (baseline: {res['baseline']})",
        f"- seeds: {', '.join(map(str, res['seeds']))}; finished runs per arm: "
        + ", ".join(f"{k} {v}" for k, v in res["finished_runs"].items()),
        f"- steps: {res['steps']}; equal tokens: {res['equal_tokens']:,.0f}; target loss: "
        f"{res['target']:.4f} ({res['target_from']})",
        f"- hardware: {hw['cpu']}, {hw['cores']} cores, {hw['torch_threads']} torch threads"
        + (f", {hw['gpu']}" if hw["gpu"] else "")
        + f"; training time of all runs: {res['train_time_s']:.0f} s",
        "- p: two-sided Welch t-test of each arm against the baseline; sd: sample standard deviation; "
        "n: the runs with a value (`k of N`: N - k runs never reached the target)",
    ]
    for metric, body in res["metrics"].items():
        lines += ["", f"## {metric}: {body['about']}", ""]
        lines += [
            "| arm | mean | sd | n | diff vs baseline | t | df | p |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, row in body["arms"].items():
            cells = [row["mean"], row["sd"], row["n"], row.get("diff"), row.get("t"), row.get("df")]
            p = row.get("p")
            lines.append(
                f"| {label} | "
                + " | ".join(_fmt(c) for c in cells)
                + f" | {'-' if p is None else f'{p:.3g}'} |"
            )
    return "\n".join(lines) + "\n"


def write_results(plan: Plan, command: str = "", dest: Path | None = None) -> dict[str, Any]:
    """``results.json``, ``results.md`` and ``experiment.png`` in ``dest`` (default: the experiment
    folder); the results."""
    res = summarize(plan, command)
    dest = dest or plan.out
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (dest / "results.md").write_text(markdown(res))
    experiment_chart(
        res["curves"],
        res["final_losses"],
        dest / "experiment.png",
        f"{res['recipe'] or 'defaults'}: {len(res['seeds'])} seeds per arm",
    )
    return res
