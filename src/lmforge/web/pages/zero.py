"""ZeRO stages planner: per-device memory and data-parallel communication of DDP and ZeRO-1, -2, -3 for one
model on N devices, two ways: (a) the seed table's closed formulas (ZeRO paper, Rajbhandari et al. 2020:
``plan.memory.per_param_formula``, ``plan.comm.seed_volume`` and the exact ring volume
``plan.comm.dp_volume``) for the model's parameter count, and (b) ``lmforge estimate`` for the same model
with ``parallel.dp_replicate = N`` (DDP) or ``parallel.dp_shard = N`` and ``parallel.zero = 1 / 2 / 3``.
Seed defaults: 13B (``llama-13b``), 8 GPUs."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.plan import hardware, models
from lmforge.plan.comm import dp_volume, seed_volume
from lmforge.plan.memory import optimizer_key, per_param_formula, state_bytes_per_param
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
    "model": "llama-13b",
    "gpus": 8,
    "precision": "fp16",
    "optimizer": "adam",
    "accounting": "zero-paper",
    "gpu": "h100-80gb",
}
PAPER_VALUE_BYTES = 2  # the seed table counts 16-bit values

blueprint = Blueprint("zero", __name__)


def zero_inputs(
    model: str, gpus: int, train_precision: str, optimizer: str, accounting: str, gpu: str, kind: str
):
    """``lmforge estimate --model MODEL --gpu GPU --gpus N --weights ACCOUNTING --train.precision=P
    --optim.name=O`` with ``--parallel.dp_replicate=N`` (``ddp``) or ``--parallel.dp_shard=N
    --parallel.zero=K`` (``zeroK``)."""
    overrides: dict[str, object] = {
        "train.precision": train_precision,
        "optim.name": optimizer,
        **layout_overrides(kind, gpus),
    }
    return PlannerInputs(model, gpu, gpus, accounting, overrides)


def formula_row(kind: str, psi: int, gpus: int, k: float, accounting: str) -> dict:
    """The seed table's row for ``kind`` (bytes per device): model states by
    ``per_param_formula(kind, psi, gpus, k, accounting)`` (zero-paper: DDP ``2Ψ + 2Ψ + KΨ``, ZeRO-1
    ``2Ψ + 2Ψ + KΨ/N``, ZeRO-2 ``2Ψ + (2 + K)Ψ/N``, ZeRO-3 ``(2 + 2 + K)Ψ/N`` with the paper's ``K`` = 4
    master + ``k`` state bytes, 12 for Adam); communication ``seed_volume`` (2Ψ, 2Ψ, 2Ψ, 3Ψ values) in
    16-bit bytes, and the exact ring volume ``dp_volume(kind, Ψ, N, 2, accounting="zero-paper")``."""
    s = per_param_formula(kind, psi, gpus, k, accounting)
    volume = seed_volume(kind, psi)
    return {
        "kind": kind,
        "params": s.params,
        "grads": s.grads,
        "master": s.master,
        "optim": s.optim,
        "total": s.total,
        "comm_values": volume,
        "comm_psi": volume / psi,
        "comm_bytes": PAPER_VALUE_BYTES * volume,
        "comm_ring_bytes": dp_volume(kind, psi, gpus, PAPER_VALUE_BYTES, accounting="zero-paper"),
    }


def planner_row(inputs: PlannerInputs, kind: str) -> dict:
    """``lmforge estimate``'s figures for one layout: model states, the device total at the peak
    (activations, temporaries, overhead included), whether it fits, data-parallel bytes per step."""
    est = inputs.estimate()
    return {
        "kind": kind,
        "layout": est.layout.describe(),
        "command": inputs.command(),
        "params": est.states.params,
        "grads": est.states.grads,
        "master": est.states.master,
        "optim": est.states.optim,
        "states_total": est.states.total,
        "total": est.total,
        "limit": est.margin * est.memory_bytes,
        "fits": est.fits,
        "comm_dp": est.comm.dp,
        "step_s": est.step_s,
        "n_params": est.n_params,
    }


def zero_figures(
    model: str, gpus: int, train_precision: str, optimizer: str, accounting: str, gpu: str
) -> dict:
    """Both tables for DDP, ZeRO-1, -2, -3: the formulas for the model's parameter count ``Ψ`` (the
    planner's ``n_params``), the planner's rows and its measured accuracy (``web/accuracy.py``)."""
    planner = [
        planner_row(zero_inputs(model, gpus, train_precision, optimizer, accounting, gpu, kind), kind)
        for kind in LAYOUTS
    ]
    psi = planner[0]["n_params"]
    k = state_bytes_per_param(optimizer_key(optimizer))
    return {
        "psi": psi,
        "gpus": gpus,
        "k": k,
        "paper_k": k + (4 if accounting == "zero-paper" else 0),
        "accounting": accounting,
        "formula": [formula_row(kind, psi, gpus, k, accounting) for kind in LAYOUTS],
        "planner": planner,
        "accuracy": planner_accuracy(),
    }


@blueprint.get("/zero")
def view():
    return render_template(
        "zero.html",
        title="ZeRO stages",
        defaults=DEFAULTS,
        **choices(),
    )


@blueprint.get("/api/zero")
@json_api
def api():
    return zero_figures(
        arg_choice("model", DEFAULTS["model"], list(models.MODELS)),
        arg_int("gpus", DEFAULTS["gpus"], 2, 4096),
        arg_choice("precision", DEFAULTS["precision"], PRECISIONS),
        arg_choice("optimizer", DEFAULTS["optimizer"], OPTIMIZERS),
        arg_choice("accounting", DEFAULTS["accounting"], ACCOUNTINGS),
        arg_choice("gpu", DEFAULTS["gpu"], list(hardware.GPUS)),
    )


PAGE = Page(
    "zero",
    "ZeRO stages",
    40,
    "per-device memory and communication of DDP and ZeRO-1, -2, -3 (seed: 13B on 8 GPUs), the seed table's "
    "formulas beside lmforge's planner",
    blueprint,
)
