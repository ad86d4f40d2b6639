"""The experiment's plan from its flags, checked before any run: the arms (each combination of the
``--vary`` values, the first value of each key making the baseline arm), the seeds, the metrics, and the
order of the runs (interleaved: seed 1 of every arm, then seed 2, ...), each run's folder and config."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.config import Config
from lmforge.errors import ConfigError, UserError
from lmforge.recipe import config_keys, load_config, parse_value

METRICS = {
    "val_loss": "validation loss at equal tokens (the fewest tokens any run trained on)",
    "steps_to_target": "optimizer steps to the target validation loss (interpolated between evaluations)",
    "tokens_to_target": "training tokens to the target validation loss",
    "wall_time": "training wall clock (seconds, summary.json's wall_time_s)",
}
PLAN_FILE = "experiment.json"


@dataclass(frozen=True)
class Arm:
    """One combination of the varied values: ``overrides`` (dotted key -> value) and its folder name."""

    overrides: dict[str, Any]

    @property
    def label(self) -> str:
        """``key=value`` pairs joined by ``__``; characters a folder name cannot hold become ``_``."""
        text = "__".join(f"{k}={_text(v)}" for k, v in self.overrides.items())
        return re.sub(r"[^A-Za-z0-9_.=+,-]", "_", text)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class Plan:
    """What ``lmforge experiment`` runs: ``recipe`` under ``overrides``, each arm over ``seeds``."""

    recipe: str | None
    overrides: dict[str, Any]
    vary: dict[str, list[Any]]
    seeds: list[int]
    metrics: list[str]
    target: float | None
    out: Path
    arms: list[Arm] = field(default_factory=list)

    def config(self, arm: Arm, seed: int) -> Config:
        """The config of one run: the recipe, the overrides, the arm's values, ``train.seed``."""
        return load_config(self.recipe, {**self.overrides, **arm.overrides, "train.seed": seed})

    def run_dir(self, arm: Arm, seed: int) -> Path:
        return self.out / arm.label / f"seed_{seed}"

    def order(self) -> Iterator[tuple[Arm, int]]:
        """The runs, interleaved: every arm with the first seed, then every arm with the second, ..."""
        for seed in self.seeds:
            for arm in self.arms:
                yield arm, seed

    def identity(self) -> dict[str, Any]:
        """What a resumed experiment must share with the one in its folder (the seeds may grow)."""
        return {"recipe": self.recipe, "overrides": self.overrides, "vary": self.vary}


def parse_vary(specs: list[str]) -> dict[str, list[Any]]:
    """``["optim.name=adamw,muon"]`` -> ``{"optim.name": ["adamw", "muon"]}`` (values read as command-line
    values); UserError for a malformed spec, a key given twice, an unknown key or ``train.seed``."""
    if not specs:
        raise UserError(
            "--vary: none given; name a config key and its values, e.g. --vary optim.name=adamw,muon"
        )
    keys = config_keys()
    vary: dict[str, list[Any]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise UserError(f"--vary {spec}: write KEY=A,B (a config key and its comma-separated values)")
        if key == "train.seed":
            raise UserError(
                "--vary train.seed: the seeds are the repeats of every arm; set their number with --seeds"
            )
        if key not in keys:
            raise UserError(f"--vary {key}: unknown config key{_close(key, list(keys))}")
        if key in vary:
            raise UserError(f"--vary {key}: given twice; list all its values in one --vary {key}=A,B")
        vary[key] = [parse_value(v.strip()) for v in values.split(",")]
    return vary


def _close(key: str, keys: list[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else ""


def make_plan(
    recipe: str | None,
    vary_specs: list[str],
    seeds: int,
    metrics: list[str] | None,
    overrides: dict[str, Any],
    target: float | None = None,
    out: str | Path | None = None,
) -> Plan:
    """The checked plan (UserError, before any run, for anything a run would refuse): at least 2 seeds
    (every report holds a p-value, which needs 2 runs per arm), at least 2 arms, known metrics, and every
    arm's config with the first seed accepted by the schema and by the build's checks."""
    from lmforge.train.build import validate

    vary = parse_vary(vary_specs)
    if seeds < 2:
        raise UserError(f"--seeds {seeds}: at least 2 (a p-value needs 2 runs per arm); e.g. --seeds 3")
    unknown = [m for m in metrics or [] if m not in METRICS]
    if unknown:
        raise UserError(f"--metric {unknown[0]}: unknown metric; choose from {', '.join(METRICS)}")
    if "train.seed" in overrides:
        raise UserError("--train.seed: the seeds are set by --seeds (train.seed + 0, 1, ...); drop the flag")
    arms = [Arm(dict(zip(vary, values, strict=True))) for values in itertools.product(*vary.values())]
    if len(arms) < 2:
        raise UserError(f"--vary: {len(arms)} arm; give at least 2 values to compare (KEY=A,B)")
    if len({a.label for a in arms}) < len(arms):
        raise UserError("--vary: two values give the same arm folder name; use distinct values")
    base = load_config(recipe, overrides)
    first = base.train.seed
    default_out = Path("experiments") / "-".join([Path(recipe).stem if recipe else "defaults", *vary])
    seed_list = [first + i for i in range(seeds)]
    out_dir = Path(out) if out else default_out
    plan = Plan(recipe, overrides, vary, seed_list, list(metrics or METRICS), target, out_dir, arms)
    for arm in arms:
        try:
            validate(plan.config(arm, first))
        except ConfigError as exc:
            values = ", ".join(f"{k}={_text(v)}" for k, v in arm.overrides.items())
            raise ConfigError(f"--vary ({values}): {exc}") from None
    check_folder(plan)
    return plan


def check_folder(plan: Plan) -> None:
    """UserError when ``plan.out`` holds another experiment (another recipe, overrides or arms)."""
    saved = plan.out / PLAN_FILE
    if saved.is_file():
        old = json.loads(saved.read_text())
        if {k: old.get(k) for k in plan.identity()} != json.loads(json.dumps(plan.identity())):
            raise UserError(
                f"--out {plan.out}: holds another experiment (recipe, overrides or --vary differ, see "
                f"{saved}); choose another --out"
            )
    elif plan.out.exists() and any(plan.out.iterdir()):
        raise UserError(f"--out {plan.out}: not empty and not an experiment folder; choose another --out")
