"""Pipeline parallelism planner: the action order of PyTorch's pipeline schedules (GPipe, 1F1B,
interleaved 1F1B, zero bubble, ZB-V) on a time x rank grid, its measured bubble beside
``bubble_fraction(p, m, v)`` (``web/figures_pipeline.py``)."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.parallel.pipeline import SCHEDULES
from lmforge.web.api import arg_choice, arg_int, json_api
from lmforge.web.figures_pipeline import LIMITS, pipeline_figures
from lmforge.web.registry import Page

# the seed tool: 4 stages, micro-batch 4, with bubbles
DEFAULTS = {"schedule": "1f1b", "pp": 4, "microbatches": 4, "stages_per_rank": 2}

blueprint = Blueprint("pipeline", __name__)


@blueprint.get("/pipeline")
def view():
    return render_template(
        "pipeline.html",
        title="Pipeline parallelism",
        defaults=DEFAULTS,
        schedules=list(SCHEDULES),
        limits=LIMITS,
    )


@blueprint.get("/api/pipeline")
@json_api
def api() -> dict:
    return pipeline_figures(
        arg_choice("schedule", DEFAULTS["schedule"], tuple(SCHEDULES)),
        arg_int("pp", DEFAULTS["pp"], 1, LIMITS["pp"]),
        arg_int("microbatches", DEFAULTS["microbatches"], 1, LIMITS["microbatches"]),
        arg_int("stages_per_rank", DEFAULTS["stages_per_rank"], 1, LIMITS["stages_per_rank"]),
    )


PAGE = Page(
    "pipeline",
    "Pipeline",
    80,
    "4 stages, 4 micro-batches: the real action order of torch's GPipe, 1F1B and interleaved schedules, "
    "and the bubble measured on it against (p-1)/(v m+p-1)",
    blueprint,
)
