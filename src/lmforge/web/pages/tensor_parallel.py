"""The tensor-parallel planner: one matmul split by columns and by rows, shard shapes, FLOPs per GPU, the
collectives' sizes (``plan.comm``), the Megatron MLP pair, and a torch check of the shards' products
(``web/figures_parallel.tensor_parallel``)."""

from __future__ import annotations

from flask import Blueprint, render_template

from lmforge.web.api import arg_int, json_api
from lmforge.web.figures_parallel import CHECK_MAX_DIM, tensor_parallel
from lmforge.web.registry import Page

blueprint = Blueprint("tensor-parallel", __name__)
DEFAULTS = {"m": 4096, "k": 4096, "n": 4096, "gpus": 2, "dtype_bytes": 2}


@blueprint.get("/tensor-parallel")
def view():
    return render_template(
        "tensor-parallel.html", title="Tensor parallelism", defaults=DEFAULTS, check_max=CHECK_MAX_DIM
    )


@blueprint.get("/api/tensor-parallel")
@json_api
def api() -> dict:
    return tensor_parallel(
        m=arg_int("m", DEFAULTS["m"], 1, 1 << 20),
        k=arg_int("k", DEFAULTS["k"], 1, 1 << 17),
        n=arg_int("n", DEFAULTS["n"], 1, 1 << 17),
        gpus=arg_int("gpus", DEFAULTS["gpus"], 1, 64),
        dtype_bytes=arg_int("dtype_bytes", DEFAULTS["dtype_bytes"], 1, 8),
    )


PAGE = Page(
    "tensor-parallel",
    "Tensor parallel",
    70,
    "a matmul split by columns and by rows, the all-gather / all-reduce sizes, a torch check (animated)",
    blueprint,
)
