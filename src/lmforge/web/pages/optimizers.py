"""Optimizer comparison (seed: SGD, SGD + momentum, Adam, AdamW, Adafactor, Lion on a non-convex landscape,
100 steps, trajectories): lmforge's own optimizers on 2-D test functions
(:mod:`lmforge.web.figures_optimizers`), with the optimizer-state bytes per parameter of each."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from lmforge.web.api import BadInput, arg_choice, arg_float, arg_int, json_api
from lmforge.web.figures_optimizers import FUNCTIONS, OPTIMIZERS, optimizers_figures
from lmforge.web.registry import Page

blueprint = Blueprint("optimizers", __name__)

DEFAULT_FUNCTION = "rosenbrock"
DEFAULTS = {"function": DEFAULT_FUNCTION, "steps": 100, "weight_decay": 0.1}


@blueprint.get("/optimizers")
def optimizers_page():
    per_function = {
        name: {"start": list(t.start), "lr": t.lr, "x_range": list(t.x_range), "y_range": list(t.y_range)}
        for name, t in FUNCTIONS.items()
    }
    return render_template(
        "optimizers.html",
        title="Optimizer comparison",
        defaults=DEFAULTS,
        functions=list(FUNCTIONS),
        per_function=per_function,
        start=FUNCTIONS[DEFAULT_FUNCTION].start,
        lr=FUNCTIONS[DEFAULT_FUNCTION].lr,
        optimizers=OPTIMIZERS,
    )


@blueprint.get("/api/optimizers")
@json_api
def optimizers_api():
    function = arg_choice("function", DEFAULT_FUNCTION, tuple(FUNCTIONS))
    t = FUNCTIONS[function]
    start = (arg_float("x0", t.start[0], -1e3, 1e3), arg_float("y0", t.start[1], -1e3, 1e3))
    lrs = {}
    for o in OPTIMIZERS:
        on = request.args.get(o.key, "1")
        if on not in ("0", "1"):
            raise BadInput(f"{o.key}: {on!r} is not 0 or 1")
        if on == "1":
            lrs[o.key] = arg_float(f"lr_{o.key}", t.lr[o.key], 1e-12, 100)
    return optimizers_figures(
        function,
        start,
        arg_int("steps", DEFAULTS["steps"], 1, 2000),
        lrs,
        arg_float("weight_decay", DEFAULTS["weight_decay"], 0, 10),
    )


PAGE = Page(
    "optimizers",
    "Optimizer comparison",
    110,
    "lmforge's SGD, Adam, AdamW, Adafactor and Lion on 2-D test functions: trajectories, loss, state bytes",
    blueprint,
)
