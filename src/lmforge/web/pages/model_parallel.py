"""The model-parallel planner: naive layer-wise model parallelism (``parallel.pipeline.stage_layers``), the
activations passed GPU to GPU (``plan.comm.pp_volume``) and the idle time of one micro-batch
(``parallel.pipeline.bubble_fraction(p, 1)``); ``web/figures_parallel.model_parallel``."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.web.api import arg_int, json_api
from lmforge.web.figures_parallel import model_parallel
from lmforge.web.registry import Page

blueprint = Blueprint("model-parallel", __name__)
DEFAULTS = {"layers": 12, "gpus": 4, "batch": 8, "seq": 512, "d_model": 768, "dtype_bytes": 2}


@blueprint.get("/model-parallel")
def view():
    return render_template("model-parallel.html", title="Model parallelism (layer-wise)", defaults=DEFAULTS)


@blueprint.get("/api/model-parallel")
@json_api
def api() -> dict:
    return model_parallel(
        layers=arg_int("layers", DEFAULTS["layers"], 1, 512),
        gpus=arg_int("gpus", DEFAULTS["gpus"], 1, 64),
        batch=arg_int("batch", DEFAULTS["batch"], 1, 1 << 16),
        seq=arg_int("seq", DEFAULTS["seq"], 1, 1 << 22),
        d_model=arg_int("d_model", DEFAULTS["d_model"], 1, 1 << 17),
        dtype_bytes=arg_int("dtype_bytes", DEFAULTS["dtype_bytes"], 1, 8),
    )


PAGE = Page(
    "model-parallel",
    "Model parallel",
    60,
    "layers split over GPUs, activations passed GPU to GPU, one GPU busy at a time (animated)",
    blueprint,
)
