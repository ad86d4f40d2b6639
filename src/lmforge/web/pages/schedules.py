"""LR schedules (seed: constant, linear decay, cosine, warmup + linear; 10,000 steps; warmup highlighted):
every lmforge schedule computed by ``lmforge.optim.schedules`` (see :mod:`lmforge.web.figures_schedules`)."""

from __future__ import annotations

from flask import Blueprint, render_template, request

from lmforge.web.api import BadInput, arg_choice, arg_float, arg_int, json_api
from lmforge.web.figures_schedules import SEED_SERIES, SERIES, schedules_figures
from lmforge.web.registry import Page

blueprint = Blueprint("schedules", __name__)

DEFAULTS = {
    "peak_lr": 3e-4,
    "steps": 10000,
    "warmup": 1000,
    "min_lr_ratio": 0.1,
    "probe": 5000,
    "eval_interval": 250,
    "plateau_stall": 5000,
    "wsd_decay_fraction": 0.2,
    "wsd_decay_shape": "1-sqrt",
    "step_step_size": 2000,
    "step_gamma": 0.5,
    "polynomial_power": 2.0,
    "cyclic_cycle_steps": 2000,
    "one_cycle_div_factor": 25.0,
    "plateau_patience": 2,
    "plateau_factor": 0.5,
    "plateau_threshold": 0.001,
}
WSD_SHAPES = ("linear", "cosine", "1-sqrt")


@blueprint.get("/schedules")
def schedules_page():
    return render_template(
        "schedules.html", title="LR schedules", defaults=DEFAULTS, series=SERIES, seed=SEED_SERIES
    )


def _selected() -> list[str]:
    """The series whose checkbox is "1"; with no checkbox parameter at all, the seed's four."""
    if not any(s.key in request.args for s in SERIES):
        return list(SEED_SERIES)
    out = []
    for s in SERIES:
        raw = request.args.get(s.key, "0")
        if raw not in ("0", "1"):
            raise BadInput(f"{s.key}: {raw!r} is not 0 or 1")
        if raw == "1":
            out.append(s.key)
    return out


@blueprint.get("/api/schedules")
@json_api
def schedules_api():
    steps = arg_int("steps", DEFAULTS["steps"], 1, 10_000_000)
    d = DEFAULTS
    sub = {
        "wsd": {
            "decay_fraction": arg_float("wsd_decay_fraction", d["wsd_decay_fraction"], 1e-9, 1),
            "decay_shape": arg_choice("wsd_decay_shape", d["wsd_decay_shape"], WSD_SHAPES),
        },
        "step": {
            "step_size": arg_int("step_step_size", d["step_step_size"], 1),
            "gamma": arg_float("step_gamma", d["step_gamma"], 1e-9, 1),
        },
        "polynomial": {"power": arg_float("polynomial_power", d["polynomial_power"], 1e-9, 100)},
        "cyclic": {"cycle_steps": arg_int("cyclic_cycle_steps", d["cyclic_cycle_steps"], 2)},
        "one_cycle": {"div_factor": arg_float("one_cycle_div_factor", d["one_cycle_div_factor"], 1, 1e6)},
        "plateau": {
            "patience": arg_int("plateau_patience", d["plateau_patience"], 0, 10_000),
            "factor": arg_float("plateau_factor", d["plateau_factor"], 1e-9, 0.999999),
            "threshold": arg_float("plateau_threshold", d["plateau_threshold"], 0, 1),
        },
    }
    warmup = arg_float("warmup", d["warmup"], 0, steps)
    if warmup >= 1 and warmup != int(warmup):
        raise BadInput(f"warmup: {warmup} is neither a whole number of steps nor a fraction below 1")
    probe = arg_int("probe", d["probe"], 0, steps - 1)
    return schedules_figures(
        peak_lr=arg_float("peak_lr", d["peak_lr"], 1e-12, 100),
        total=steps,
        warmup=warmup,
        min_lr_ratio=arg_float("min_lr_ratio", d["min_lr_ratio"], 0, 1),
        selected=_selected(),
        sub=sub,
        probes=[probe],
        eval_interval=arg_int("eval_interval", d["eval_interval"], 1, 10_000_000),
        plateau_stall=arg_int("plateau_stall", d["plateau_stall"], 0, 10_000_000),
    )


PAGE = Page(
    "schedules",
    "LR schedules",
    100,
    "every lmforge learning-rate schedule, computed by its own schedule functions, warmup shaded",
    blueprint,
)
