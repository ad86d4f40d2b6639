"""GPU memory planner: the per-device breakdown of ``lmforge estimate`` (parameters, gradients, master
weights, optimizer states, activations, temporaries, overhead; total against ``margin x memory``) and how
the total and its parts scale with the micro-batch and the sequence length, every point a call of the
planner (``lmforge.plan.request``) with the page's inputs. Seed defaults: a 6.7B model (``llama-7b``, 6.74B
parameters), batch 32, sequence 512, fp16, Adam."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.errors import UserError
from lmforge.plan import hardware, models
from lmforge.web.accuracy import planner_accuracy
from lmforge.web.api import arg_choice, arg_int, json_api
from lmforge.web.planner_inputs import (
    ACCOUNTINGS,
    LAYOUTS,
    OPTIMIZERS,
    PRECISIONS,
    PlannerInputs,
    choices,
    layout_overrides,
)
from lmforge.web.registry import Page

DEFAULTS = {
    "model": "llama-7b",
    "micro_batch": 32,
    "seq_len": 512,
    "precision": "fp16",
    "optimizer": "adam",
    "gpu": "h100-80gb",
    "gpus": 1,
    "layout": "zero3",
    "checkpointing": "none",
    "accounting": "lmforge",
}
CHECKPOINTING = ("none", "selective", "full", "every:2", "every:3", "every:4", "every:8")
BATCH_POINTS = (1, 2, 4, 8, 16, 32, 64)
SEQ_POINTS = (128, 256, 512, 1024, 2048, 4096)

blueprint = Blueprint("memory", __name__)


def memory_inputs(
    model: str,
    micro_batch: int,
    seq_len: int,
    train_precision: str,
    optimizer: str,
    gpu: str,
    gpus: int,
    layout: str,
    checkpointing: str,
    accounting: str,
) -> PlannerInputs:
    """The page's controls as ``lmforge estimate --model MODEL --gpu GPU --gpus GPUS --weights ACCOUNTING
    --train.micro_batch_size=B --data.seq_len=T --train.precision=P --optim.name=O
    --train.activation_checkpointing=C`` plus the layout's ``parallel.*`` keys."""
    overrides: dict[str, object] = {
        "train.micro_batch_size": micro_batch,
        "data.seq_len": seq_len,
        "train.precision": train_precision,
        "optim.name": optimizer,
        "train.activation_checkpointing": checkpointing,
        **layout_overrides(layout, gpus),
    }
    return PlannerInputs(model, gpu, gpus, accounting, overrides)


def at_peak(est) -> dict:
    """What is alive in the step's peak phase, read generically from the estimate (the phases' names are
    the planner's): ``phase`` (``peak_phase``); ``alive``, ``[row, bytes]`` for each row of
    ``Estimate.rows()`` (made of the ``*_at_peak`` fields) that holds bytes in that phase, in the
    breakdown's order; ``parts``, for every ``ROW_at_peak`` or ``ROW_alive`` field of ``to_dict()`` that
    is a dict of named parts, its non-zero ``[part, bytes]`` under ``ROW``; and the activations the step
    holds for the backward at their largest (``activations``, what the activation table lists) beside
    those alive at the peak (``activations_at_peak``): once the backward has freed them the row is 0
    while the table is not."""
    parts = {
        key.removesuffix("_at_peak").removesuffix("_alive").replace("_", " "): [
            [k, v] for k, v in value.items() if v
        ]
        for key, value in est.to_dict().items()
        if key.endswith(("_at_peak", "_alive")) and isinstance(value, dict)
    }
    return {
        "phase": est.peak_phase,
        "alive": [[row, v] for row, v in est.rows().items() if v],
        "parts": parts,
        "activations": est.activations,
        "activations_at_peak": est.activations_at_peak,
    }


def breakdown(est) -> dict:
    """One estimate as the page draws it: ``rows`` (``Estimate.rows()``: the peak's breakdown, adding up
    to ``total``), the limit ``margin x memory``, whether it fits, and the figures named beside them."""
    return {
        "rows": est.rows(),
        "total": est.total,
        "memory_bytes": est.memory_bytes,
        "margin": est.margin,
        "limit": est.margin * est.memory_bytes,
        "fits": est.fits,
        "n_params": est.n_params,
        "peak_phase": est.peak_phase,
        "at_peak": at_peak(est),
        "activations": est.activations,
        "activation_parts": est.activation_parts,
        "layout": est.layout.describe(),
        "step_s": est.step_s,
        "tokens_per_s": est.tokens_per_s,
        "attention": est.attention,
        "warnings": est.warnings,
    }


def scaling(inputs: PlannerInputs, key: str, values: list[int]) -> list[dict]:
    """The breakdown at each value of the override ``key`` (the other inputs as given); a point the
    planner refuses carries its one-line ``error`` instead."""
    out = []
    for v in values:
        try:
            out.append({"value": v, **breakdown(inputs.but({key: v}).estimate())})
        except UserError as exc:
            out.append({"value": v, "error": str(exc)})
    return out


def points(base: tuple[int, ...], chosen: int) -> list[int]:
    """The scaling axis: ``base`` and the chosen value, sorted."""
    return sorted({*base, chosen})


def memory_figures(inputs: PlannerInputs, micro_batch: int, seq_len: int) -> dict:
    """The breakdown of ``inputs`` and its scaling with the micro-batch (1..64) and the sequence
    (128..4096); the command that prints the same figures; the planner's measured accuracy
    (``web/accuracy.py``)."""
    est = inputs.estimate()
    return {
        "command": inputs.command(),
        "accuracy": planner_accuracy(),
        **breakdown(est),
        "by_batch": scaling(inputs, "train.micro_batch_size", points(BATCH_POINTS, micro_batch)),
        "by_seq": scaling(inputs, "data.seq_len", points(SEQ_POINTS, seq_len)),
    }


@blueprint.get("/memory")
def view():
    return render_template(
        "memory.html",
        title="GPU memory",
        defaults=DEFAULTS,
        checkpointing=CHECKPOINTING,
        **choices(),
    )


@blueprint.get("/api/memory")
@json_api
def api():
    micro_batch = arg_int("micro_batch", DEFAULTS["micro_batch"], 1, 4096)
    seq_len = arg_int("seq_len", DEFAULTS["seq_len"], 8, 1 << 17)
    inputs = memory_inputs(
        arg_choice("model", DEFAULTS["model"], list(models.MODELS)),
        micro_batch,
        seq_len,
        arg_choice("precision", DEFAULTS["precision"], PRECISIONS),
        arg_choice("optimizer", DEFAULTS["optimizer"], OPTIMIZERS),
        arg_choice("gpu", DEFAULTS["gpu"], list(hardware.GPUS)),
        arg_int("gpus", DEFAULTS["gpus"], 1, 4096),
        arg_choice("layout", DEFAULTS["layout"], LAYOUTS),
        arg_choice("checkpointing", DEFAULTS["checkpointing"], CHECKPOINTING),
        arg_choice("accounting", DEFAULTS["accounting"], ACCOUNTINGS),
    )
    return memory_figures(inputs, micro_batch, seq_len)


PAGE = Page(
    "memory",
    "GPU memory",
    20,
    "the planner's per-device memory breakdown (seed: 6.7B model, batch 32, sequence 512, fp16, Adam) and "
    "how it scales with the micro-batch and the sequence",
    blueprint,
)
