"""Hybrid parallelism planner: each GPU's memory, the step time and the communication of every dimension
for a DP x TP x PP layout on nodes x 8 GPUs, all from ``lmforge estimate --json`` for the same flags
(``web/figures_hybrid.py``), and the GPU grid coloured by mesh group."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from lmforge.parallel.pipeline import SCHEDULES
from lmforge.plan import hardware, models
from lmforge.plan.estimate import GPUS_PER_NODE, POLICIES
from lmforge.web.api import arg_choice, arg_int, json_api
from lmforge.web.figures_hybrid import HybridInputs, hybrid_figures
from lmforge.web.registry import Page

DEFAULTS = HybridInputs()  # the seed tool: 4 nodes x 8 GPUs for a 65B model
PRECISIONS = ("bf16", "fp16", "fp8", "fp32")
DEVICES = tuple(n for n in hardware.NAMES if n != "cpu")

blueprint = Blueprint("hybrid", __name__)


@blueprint.get("/hybrid")
def view():
    return render_template(
        "hybrid.html",
        title="Hybrid parallelism",
        defaults=DEFAULTS,
        models=list(models.MODELS),
        devices=DEVICES,
        schedules=list(SCHEDULES),
        policies=POLICIES,
        precisions=PRECISIONS,
        gpus_per_node=GPUS_PER_NODE,
    )


@blueprint.get("/api/hybrid")
@json_api
def api() -> dict:
    d = DEFAULTS
    inputs = HybridInputs(
        model=arg_choice("model", d.model, tuple(models.MODELS)),
        gpu=arg_choice("gpu", d.gpu, DEVICES),
        nodes=arg_int("nodes", d.nodes, 1, 64),
        tp=arg_int("tp", d.tp, 1, 4096),
        pp=arg_int("pp", d.pp, 1, 4096),
        dp_replicate=arg_int("dp_replicate", d.dp_replicate, 1, 4096),
        dp_shard=arg_int("dp_shard", d.dp_shard, 1, 4096),
        zero=int(arg_choice("zero", str(d.zero), ("1", "2", "3"))),
        micro_batch=arg_int("micro_batch", d.micro_batch, 1, 4096),
        pp_microbatches=arg_int("pp_microbatches", d.pp_microbatches, 0, 4096),
        pp_schedule=arg_choice("pp_schedule", d.pp_schedule, tuple(SCHEDULES)),
        checkpointing=arg_choice("checkpointing", d.checkpointing, POLICIES),
        precision=arg_choice("precision", d.precision, PRECISIONS),
    )
    return hybrid_figures(inputs, search=request.args.get("search") == "1")


PAGE = Page(
    "hybrid",
    "Hybrid",
    90,
    "4 nodes x 8 GPUs for a 65B model: each GPU's memory, step time and communication per dimension for "
    "DP x TP x PP (lmforge estimate), and which mesh group each GPU is in",
    blueprint,
)
