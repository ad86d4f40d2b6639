"""``lmforge experiment``: arms of a recipe over several seeds, interleaved, then each metric's mean,
spread and Welch p-value against the first arm (``experiment/``)."""

from __future__ import annotations

import argparse
import shlex
import signal

from lmforge.cli.train import SIGNALS
from lmforge.recipe import parse_overrides


def add_commands(sub: argparse._SubParsersAction) -> None:
    from lmforge.experiment.plan import METRICS

    p = sub.add_parser(
        "experiment",
        help="compare config values over several seeds: mean, spread, Welch p-values, a plot",
        description="Train every arm (each combination of the --vary values; the first value of each key "
        "makes the baseline arm) with --seeds seeds (train.seed, train.seed+1, ...), interleaved: seed 1 of "
        "every arm, then seed 2, ... Each run is an ordinary run folder OUT/ARM/seed_S; finished runs are "
        "not run again, so the same command resumes. Then OUT/results.json, results.md and experiment.png: "
        "per metric each arm's mean, sample sd and n, and against the baseline the difference and a "
        "two-sided Welch t-test p-value. Any config key can be set for every arm as --SECTION.KEY=VALUE.",
        epilog="metrics: " + "; ".join(f"{k}: {v}" for k, v in METRICS.items()),
    )
    p.add_argument("recipe", metavar="RECIPE", help="TOML recipe every arm starts from")
    p.add_argument("--seeds", type=int, required=True, help="runs per arm (at least 2)")
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="KEY=A,B",
        help="a config key and its values (repeatable)",
    )
    p.add_argument(
        "--metric", action="append", default=None, metavar="NAME", help="report only these (repeatable)"
    )
    p.add_argument(
        "--target", type=float, help="target validation loss (default: the baseline arm's mean val_loss)"
    )
    p.add_argument("--out", help="experiment folder (default: experiments/<recipe>-<varied keys>)")
    p.set_defaults(func=cmd_experiment, overrides=True)


def command_line(args: argparse.Namespace, extra: list[str]) -> str:
    """The command that regenerates the experiment, as results.md states it."""
    words = ["lmforge", "experiment", args.recipe, "--seeds", str(args.seeds)]
    words += [f"--vary={v}" for v in args.vary] + [f"--metric={m}" for m in args.metric or []]
    words += [f"--target={args.target}"] if args.target is not None else []
    return shlex.join(words + ([f"--out={args.out}"] if args.out else []) + extra)


def cmd_experiment(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.experiment.plan import make_plan
    from lmforge.experiment.results import write_results
    from lmforge.experiment.run import run_experiment

    plan = make_plan(
        args.recipe, args.vary, args.seeds, args.metric, parse_overrides(extra), args.target, args.out
    )
    print(f"experiment folder: {plan.out}; {len(plan.arms)} arms x {len(plan.seeds)} seeds")
    records = run_experiment(plan)
    ran = sum(r.status != "skipped" for r in records)
    if records and records[-1].status == "stopped":
        last = records[-1]
        print(
            f"stopped during {last.run_dir} ({last.reason or 'requested'}); run the same command to continue"
        )
        return 128 + signal.Signals[last.reason].value if last.reason in SIGNALS else 0
    print(f"{ran} runs trained, {len(records) - ran} finished before")
    res = write_results(plan, command_line(args, extra))
    for metric, body in res["metrics"].items():
        cells = []
        for label, row in body["arms"].items():
            p = row.get("p")
            mean = "-" if row["mean"] is None else f"{row['mean']:.4g}"
            sd = "-" if row["sd"] is None else f"{row['sd']:.2g}"
            cells.append(f"{label} {mean} +- {sd} (n={row['n']}{'' if p is None else f', p={p:.3g}'})")
        print(f"{metric}: " + "; ".join(cells))
    print(f"results: {plan.out / 'results.md'}, {plan.out / 'results.json'}, {plan.out / 'experiment.png'}")
    return 0
