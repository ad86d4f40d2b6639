"""The data-parallel planner: the global batch split over the GPUs, a full replica on each, and the ring
all-reduce of the gradients with its size from ``plan/comm.py`` (``web/figures_parallel.data_parallel``)."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.web.api import arg_choice, arg_float, arg_int, json_api
from lmforge.web.figures_parallel import DTYPE_BYTES, MODEL_CHOICES, data_parallel
from lmforge.web.registry import Page

blueprint = Blueprint("data-parallel", __name__)
DEFAULTS = {"gpus": 4, "batch": 32, "model": "gpt2-124m", "grad_dtype": "fp32", "params_m": 100.0}


@blueprint.get("/data-parallel")
def view():
    return render_template(
        "data-parallel.html",
        title="Data parallelism",
        defaults=DEFAULTS,
        models=MODEL_CHOICES,
        dtypes=tuple(DTYPE_BYTES),
    )


@blueprint.get("/api/data-parallel")
@json_api
def api() -> dict:
    return data_parallel(
        gpus=arg_int("gpus", DEFAULTS["gpus"], 1, 64),
        batch=arg_int("batch", DEFAULTS["batch"], 1, 1 << 20),
        model=arg_choice("model", DEFAULTS["model"], MODEL_CHOICES),
        grad_dtype=arg_choice("grad_dtype", DEFAULTS["grad_dtype"], tuple(DTYPE_BYTES)),
        custom_millions=arg_float("params_m", DEFAULTS["params_m"], 0.001, 1e7),
    )


PAGE = Page(
    "data-parallel",
    "Data parallel",
    50,
    "the batch split over GPUs, a replica on each, the ring all-reduce of the gradients (animated)",
    blueprint,
)
