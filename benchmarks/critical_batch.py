"""The critical batch size measured directly, against the gradient noise scale's prediction, over seeds.

McCandlish et al. (2018) model the steps ``S`` and the examples ``E = B S`` a batch size ``B`` needs to reach
a given loss as ``S = S_min (1 + B_crit / B)`` and ``E = E_min (1 + B / B_crit)``, with ``B_crit = E_min /
S_min``: below ``B_crit`` a larger batch saves steps at little extra data, above it data is wasted. So
``S`` is linear in ``1 / B``, and a least-squares line ``S = a + b / B`` through the measured points gives
``S_min = a`` and ``B_crit = b / a`` (:func:`fit_critical_batch`). They also show that the simple noise
scale ``B_simple = tr(Sigma) / |G|^2`` predicts ``B_crit`` (up to a factor near 1 when the Hessian is
well-conditioned); Merrill et al. (2025) report it to be an unreliable proxy. Which holds here:

1. ``lmforge experiment`` machinery (``experiment/``) trains the recipe (default
   ``configs/experiment-small.toml``) at each ``--batches`` (tokens per step, at least two micro-batches
   each, so every run measures ``B_simple``) over ``--seeds`` seeds, a constant learning rate after warmup
   (the same for every batch: a tuned rate per batch, as the paper assumes, would cost a sweep per point);
2. the target loss is the highest final validation loss of any run, so that every run reaches it; steps to
   it are interpolated between evaluations (``experiment/results.py::steps_to_reach``);
3. ``B_crit`` from the fit of the per-batch mean steps, and each seed's own fit for a spread;
4. ``B_simple`` as each run logged it (``gns_critical_batch``, tokens, smoothed over steps) at the logged
   step nearest to where the run reached the target; mean and spread over all runs, and the Welch test
   of these values against the per-seed ``B_crit`` fits.

Writes ``OUT/critical_batch.json`` and ``OUT/critical_batch.png`` (steps against 1/B with the fit) besides
the experiment's own ``results.md``; prints the figures.

    python benchmarks/critical_batch.py --out DIR [--seeds 3] [--batches 512,1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from lmforge.experiment.plan import make_plan
from lmforge.experiment.results import read_runs, steps_to_reach, write_results
from lmforge.experiment.run import run_experiment
from lmforge.experiment.stats import mean, sample_sd, welch_test
from lmforge.recipe import parse_overrides

RECIPE = str(Path(__file__).resolve().parent.parent / "configs" / "experiment-small.toml")


def fit_critical_batch(batches: list[float], steps: list[float]) -> tuple[float, float]:
    """``(S_min, B_crit)`` of the least-squares line ``S = a + b / B``: ``S_min = a``, ``B_crit = b / a``."""
    x = 1.0 / np.asarray(batches, dtype=np.float64)
    b, a = np.polyfit(x, np.asarray(steps, dtype=np.float64), 1)
    return float(a), float(b / a)


def logged_noise_scale(run: Path, step: float) -> float | None:
    """``gns_critical_batch`` of ``run`` at the logged step nearest ``step`` (None if never logged)."""
    values = {
        r["step"]: r["gns_critical_batch"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r.get("gns_critical_batch") is not None
    }
    if not values:
        return None
    nearest = min(values, key=lambda s: abs(s - step))
    return float(values[nearest])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batches", default="512,1024,2048,4096,8192", help="tokens per step, comma-separated")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("lmforge.experiment").setLevel(logging.INFO)  # "run i/N: ARM seed S" per run
    overrides = {
        "train.steps": 150,
        "schedule.name": "constant",
        "schedule.warmup": 10,
        "train.eval_interval": 5,
        "train.log_interval": 5,
        "train.checkpoint_interval": 0,
        **parse_overrides(extra),
    }
    plan = make_plan(
        args.recipe,
        [f"train.tokens_per_step={args.batches}"],
        args.seeds,
        ["val_loss", "steps_to_target", "tokens_to_target", "wall_time"],
        overrides,
        out=args.out,
    )
    run_experiment(plan)
    runs = read_runs(plan)
    plan.target = max(r.curve[-1][1] for rs in runs.values() for r in rs)
    command = (
        f"python benchmarks/critical_batch.py --out {args.out} --seeds {args.seeds} --batches {args.batches}"
    )
    write_results(plan, " ".join([command, *extra]))
    batches = [int(b) for b in args.batches.split(",")]
    steps = {
        b: [steps_to_reach(r.curve, plan.target) for r in rs]
        for b, rs in zip(batches, runs.values(), strict=True)
    }
    s_min, b_crit = fit_critical_batch(batches, [mean(v) for v in steps.values()])
    per_seed = [fit_critical_batch(batches, [steps[b][i] for b in batches])[1] for i in range(args.seeds)]
    simple = [
        logged_noise_scale(plan.run_dir(arm, r.seed), s)
        for arm, rs, b in zip(plan.arms, runs.values(), batches, strict=True)
        for r, s in zip(rs, steps[b], strict=True)
    ]
    simple = [v for v in simple if v is not None and np.isfinite(v)]
    result = {
        "target": plan.target,
        "steps_to_target": {str(b): v for b, v in steps.items()},
        "s_min": s_min,
        "b_crit_tokens": b_crit,
        "b_crit_per_seed": per_seed,
        "b_simple_tokens": simple,
        "b_simple_mean": mean(simple),
        "b_simple_sd": sample_sd(simple),
        "ratio_simple_over_crit": mean(simple) / b_crit,
        "welch_simple_vs_crit_per_seed": welch_test(per_seed, simple).__dict__,
    }
    (args.out / "critical_batch.json").write_text(json.dumps(result, indent=1))
    chart(batches, steps, s_min, b_crit, args.out / "critical_batch.png")
    print(json.dumps(result))


def chart(batches: list[int], steps: dict[int, list[float]], s_min: float, b_crit: float, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 4))
    ax = fig.add_subplot(1, 1, 1)
    for b in batches:
        ax.plot([1 / b] * len(steps[b]), steps[b], "o", color="tab:blue", alpha=0.6)
    x = np.linspace(0, 1 / min(batches), 50)
    ax.plot(
        x,
        s_min * (1 + b_crit * x),
        "-",
        color="tab:red",
        label=f"S_min (1 + B_crit / B), B_crit = {b_crit:,.0f}",
    )
    ax.set_xlabel("1 / batch (1 / tokens per step)")
    ax.set_ylabel("steps to the target loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
