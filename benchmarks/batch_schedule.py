"""Batch-size schedules against a fixed batch at equal tokens, over seeds (``train.batch_schedule``).

Three arms of the same recipe (default ``configs/experiment-small.toml``), each trained on the same number
of tokens ``T = steps x B``:

- ``constant``: ``B = --full-micro`` micro-batches every step for ``--steps`` steps;
- ``ramp``: from one micro-batch up to ``B``, linearly over the first ``--ramp-fraction`` of ``T``; it needs
  more steps to read ``T``: the fewest whose ramp (``optim/batch_schedule.py::ramp_accum``, a pure function
  of the tokens seen) reaches ``T``, computed here;
- ``noise``: from two micro-batches, every ``--interval`` steps grown to the measured gradient noise
  scale ``B_simple`` (at most ``B``); its steps to ``T`` depend on the measurement, so a pilot run of the
  first seed with the constant arm's steps is read (``tokens_seen`` per step) and extrapolated at ``B``
  per step; every seed then trains that many steps. A seed whose rule keeps the batch small for longer
  reads fewer tokens in them, so this arm is reported apart (``OUT/noise/``), against the constant arm
  at the fewest tokens any of those runs read (the constant arm then mid-schedule: say so when quoting).

Both schedules scale the learning rate by ``sqrt(b / B)`` (``lr_rule = "sqrt"``). The arms run through
lmforge's experiment machinery (``experiment/run.py``: interleaved seeds, finished runs skipped) and are
reported by it (``experiment/results.py``): validation loss at equal tokens (the fewest any run trained
on, each curve linear in tokens between evaluations), steps and tokens to the constant arm's mean final
loss, with the Welch test against the constant arm. Writes ``OUT/results.md``, ``results.json`` and
``experiment.png`` (ramp against constant) and the same in ``OUT/noise/``; prints the markdown.

    python benchmarks/batch_schedule.py --out DIR [--seeds 3] [--steps 60] [--full-micro 8] [--SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from lmforge.experiment.plan import Arm, Plan
from lmforge.experiment.results import write_results
from lmforge.experiment.run import run_experiment
from lmforge.optim.batch_schedule import ramp_accum
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.launch import train

RECIPE = str(Path(__file__).resolve().parent.parent / "configs" / "experiment-small.toml")


@dataclass(frozen=True)
class NamedArm(Arm):
    """An arm whose folder and label are its name (``overrides["arm"]``)."""

    @property
    def label(self) -> str:
        return self.overrides["arm"]


class SchedulePlan(Plan):
    """A plan whose arms carry their name under ``arm`` (a folder label, not a config key)."""

    def config(self, arm: Arm, seed: int):
        over = {k: v for k, v in arm.overrides.items() if k != "arm"}
        return load_config(self.recipe, {**self.overrides, **over, "train.seed": seed})


def ramp_steps(total: int, micro: int, full: int, ramp_tokens: int) -> int:
    """The fewest steps of the ramp from one micro-batch to ``full`` whose tokens reach ``total``."""
    steps, seen = 0, 0
    while seen < total:
        seen += ramp_accum(seen, 1, full, ramp_tokens) * micro
        steps += 1
    return steps


def noise_steps(pilot: Path, total: int, full_tokens: int) -> int:
    """Steps to ``total`` tokens for the noise rule, read from a pilot run's ``tokens_seen`` per step and
    extrapolated at the full batch after its last step."""
    seen = {
        r["step"]: r["tokens_seen"]
        for r in map(json.loads, (pilot / "metrics.jsonl").read_text().splitlines())
        if "tokens_seen" in r and "loss" in r
    }
    last = max(seen)
    for step in sorted(seen):
        if seen[step] >= total:
            return step
    return last + -(-(total - seen[last]) // full_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="steps of the constant arm")
    ap.add_argument("--full-micro", type=int, default=8, help="micro-batches of the full batch")
    ap.add_argument("--ramp-fraction", type=float, default=0.25)
    ap.add_argument("--interval", type=int, default=5)
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("lmforge.experiment").setLevel(logging.INFO)  # "run i/N: ARM seed S" per run
    overrides = parse_overrides(extra)
    base = load_config(args.recipe, overrides)
    micro = base.train.micro_batch_size * base.data.seq_len
    full = args.full_micro * micro
    total = args.steps * full
    ramp_tokens = int(args.ramp_fraction * total) // micro * micro
    common = {
        **overrides,
        "train.tokens_per_step": full,
        "train.log_interval": 1,
        "train.batch_schedule.lr_rule": "sqrt",
    }
    noise = {
        "train.batch_schedule.name": "noise",
        "train.batch_schedule.start_tokens_per_step": 2 * micro,
        "train.batch_schedule.interval": args.interval,
    }
    pilot = args.out / "pilot-noise"
    if not (pilot / "summary.json").is_file():
        print(f"pilot run of the noise rule ({args.steps} steps): {pilot}", flush=True)
        cfg = load_config(args.recipe, {**common, **noise, "train.steps": args.steps})
        train(cfg, pilot, progress_bar=False)
    arms = [
        NamedArm({"arm": "constant", "train.steps": args.steps}),
        NamedArm(
            {
                "arm": "ramp",
                "train.steps": ramp_steps(total, micro, args.full_micro, ramp_tokens),
                "train.batch_schedule.name": "ramp",
                "train.batch_schedule.start_tokens_per_step": micro,
                "train.batch_schedule.ramp_tokens": ramp_tokens,
            }
        ),
        NamedArm({"arm": "noise", "train.steps": noise_steps(pilot, total, full), **noise}),
    ]
    first = base.train.seed
    plan = SchedulePlan(
        args.recipe,
        common,
        {"arm": [a.overrides for a in arms]},
        [first + i for i in range(args.seeds)],
        ["val_loss", "steps_to_target", "tokens_to_target", "wall_time"],
        None,
        args.out,
        arms,
    )
    run_experiment(plan)
    command = "python benchmarks/batch_schedule.py " + " ".join(
        [
            f"--out {args.out}",
            f"--seeds {args.seeds}",
            f"--steps {args.steps}",
            f"--full-micro {args.full_micro}",
            *extra,
        ]
    )
    # the ramp at equal tokens against the constant batch; the noise rule's runs read what their rule
    # chose in their steps (fewer tokens where it stayed small), so it is reported apart, at its fewest
    for dest, pair in ((args.out, arms[:2]), (args.out / "noise", [arms[0], arms[2]])):
        sub = dataclasses.replace(plan, arms=pair, vary={"arm": [a.overrides for a in pair]})
        write_results(sub, command, dest)
        print((dest / "results.md").read_text())
    print(
        f"equal tokens planned: {total:,}; arms' steps: "
        + ", ".join(f"{a.overrides['arm']} {a.overrides['train.steps']}" for a in arms)
    )


if __name__ == "__main__":
    main()
