"""Cleaning trade-off (seed: strictness 0-100; size, quality, diversity; optimum marked): the curves
``lmforge data sweep`` measured, read from a ``sweep.json`` under RUNS_DIR, and the optimum of the rule in
:mod:`lmforge.web.figures_cleaning`. No sweep: the page says how to make one; nothing is invented."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, current_app, render_template, request

from lmforge.corpus.sweep import optimum
from lmforge.web.api import BadInput, arg_float, json_api
from lmforge.web.figures_cleaning import HOW_TO, find_sweeps, level_knobs, load_sweep
from lmforge.web.registry import Page

blueprint = Blueprint("cleaning", __name__)


def _runs() -> Path:
    return current_app.config["RUNS_DIR"]


@blueprint.get("/cleaning")
def cleaning_page():
    return render_template(
        "cleaning.html",
        title="Cleaning trade-off",
        sweeps=find_sweeps(_runs()),
        how_to=HOW_TO.format(runs=_runs()),
    )


@blueprint.get("/api/cleaning")
@json_api
def cleaning_api():
    sweeps = find_sweeps(_runs())
    rel = request.args.get("sweep") or (sweeps[0] if sweeps else "")
    if not rel:
        return {"sweeps": [], "sweep": None, "how_to": HOW_TO.format(runs=_runs())}
    weights = tuple(arg_float(f"w_{c}", 1.0, 0, 100) for c in ("size", "quality", "diversity"))
    result = load_sweep(_runs(), rel)
    rows = result["rows"]
    higher = bool((result.get("reference") or {}).get("higher_is_better", True))
    best = optimum(rows, higher, weights)
    levels = [r["level"] for r in rows]
    raw_level = request.args.get("level")
    if raw_level in (None, ""):
        index = best["index"] if best["index"] is not None else 0
    else:
        level = arg_float("level", 0.0, 0, 100)
        if level not in levels:
            raise BadInput(f"level: {level:g} is not a level of this sweep; give one of {levels}")
        index = levels.index(level)
    return {
        "sweeps": sweeps,
        "sweep": rel,
        "levels": levels,
        "reference": result.get("reference"),
        "ngram": result.get("ngram"),
        "k_words": result.get("k_words"),
        "rows": rows,
        "optimum": best,
        "recorded_optimum": result.get("optimum"),  # what sweep.json marks (weights 1, 1, 1), as written
        "weights": list(weights),
        "index": index,
        "knobs": level_knobs(result, index),
    }


PAGE = Page(
    "cleaning",
    "Cleaning trade-off",
    120,
    "size, quality and diversity against strictness, as lmforge data sweep measured them; optimum marked",
    blueprint,
)
