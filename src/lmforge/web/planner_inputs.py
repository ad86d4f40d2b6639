"""The planner pages' inputs as ``lmforge estimate``'s: one place that turns a page's controls into an
:class:`~lmforge.plan.request.EstimateRequest` (flags and ``--SECTION.KEY=VALUE`` overrides) and into the
command line that prints the same figures, so every page figure is the one ``lmforge estimate --json``
gives for the command the page shows."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from lmforge.plan.request import EstimateRequest, run_estimate

PRECISIONS = ("fp16", "bf16", "fp32", "fp8")
OPTIMIZERS = ("adam", "adamw", "sgd", "lion", "adafactor", "adamw8bit", "muon")
LAYOUTS = ("ddp", "zero1", "zero2", "zero3")
ACCOUNTINGS = ("lmforge", "zero-paper")


def choices() -> dict[str, list[str]]:
    """The options the planner pages' controls offer, for their templates: named models, devices,
    precisions, optimizers, data-parallel layouts and accountings."""
    from lmforge.plan import hardware, models

    return {
        "models": list(models.MODELS),
        "gpus": list(hardware.GPUS),
        "precisions": list(PRECISIONS),
        "optimizers": list(OPTIMIZERS),
        "layouts": list(LAYOUTS),
        "accountings": list(ACCOUNTINGS),
    }


def layout_overrides(layout: str, gpus: int) -> dict[str, object]:
    """The ``parallel.*`` keys of a data-parallel ``layout`` on ``gpus`` devices (``parallel/layout.py``):
    ``ddp`` replicates (``dp_replicate = gpus``), ``zeroK`` shards (``dp_shard = gpus``, ``zero = K``);
    nothing on one device (there is nothing to replicate or shard)."""
    if gpus == 1:
        return {}
    if layout == "ddp":
        return {"parallel.dp_replicate": gpus}
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    return {"parallel.dp_shard": gpus, "parallel.zero": int(layout[-1])}


@dataclass(frozen=True)
class PlannerInputs:
    """``lmforge estimate --model MODEL --gpu GPU --gpus GPUS --weights WEIGHTS --KEY=VALUE ...``."""

    model: str
    gpu: str = "h100-80gb"
    gpus: int = 1
    weights: str = "lmforge"
    overrides: dict[str, object] = field(default_factory=dict)

    def request(self) -> EstimateRequest:
        """The :class:`EstimateRequest` ``lmforge estimate`` builds from :meth:`argv`."""
        flags = tuple(f"--{k}={v}" for k, v in self.overrides.items())
        return EstimateRequest(
            model=self.model, gpu=self.gpu, gpus=self.gpus, weights=self.weights, overrides=flags
        )

    def argv(self) -> list[str]:
        """The command's arguments after ``lmforge`` (``--json`` included)."""
        return [
            "estimate",
            "--model",
            self.model,
            "--gpu",
            self.gpu,
            "--gpus",
            str(self.gpus),
            "--weights",
            self.weights,
            *(f"--{k}={v}" for k, v in self.overrides.items()),
            "--json",
        ]

    def command(self) -> str:
        """:meth:`argv` as one shell line, for the page to show."""
        return shlex.join(["lmforge", *self.argv()])

    def estimate(self):
        """The planner's :class:`~lmforge.plan.estimate.Estimate` (UserError for bad input)."""
        return run_estimate(self.request()).estimate

    def but(self, overrides: dict[str, object]) -> PlannerInputs:
        """The same inputs with ``overrides`` (``{"train.micro_batch_size": 64}``) set on top."""
        return PlannerInputs(self.model, self.gpu, self.gpus, self.weights, {**self.overrides, **overrides})
