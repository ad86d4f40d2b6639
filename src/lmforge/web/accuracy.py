"""The planner's stated accuracy as the memory pages show it beside its figures: read from the accuracy
matrix (``plan/accuracy.py::load_accuracy``, real steps measured against PyTorch's memory trackers), never
typed into a page. Without a matrix the pages say the accuracy is not measured."""

from __future__ import annotations

import statistics

from lmforge.plan import accuracy

# the breakdown rows (``Estimate.rows()``) the matrix measures, each under the same name: the model states
# whole (a case's ``states``: counted tensor by tensor once the step's gradients are complete)
MEASURED_ROWS = ("parameters", "gradients", "optimizer states")
UNMEASURED_ROWS = {  # rows the matrix has no measurement of their own, and why
    "master weights": "not a row of the accuracy matrix",
    "activations": "in the peak's accuracy: the trackers file a step's buffers under other names than "
    "the planner's rows (docs/memory-accuracy.md)",
    "temporaries": "in the peak's accuracy: the trackers file a step's buffers under other names than "
    "the planner's rows (docs/memory-accuracy.md)",
    "overhead": "not measured: an allowance for the runtime and fragmentation",
}
EXACT_BYTES = 1024  # a category off by at most this many bytes in every case is shown as exact
NOT_MEASURED = "accuracy not measured: this install has no accuracy matrix (lmforge/plan/accuracy.json)"


def row_error(cases: list[dict], row: str) -> dict:
    """How far the planner's ``row`` was from the measured one over the matrix's ``cases`` (their whole
    model states where a case has them, else the rows at the peak):
    ``max_error`` = max over cases of ``|planned - measured| / measured`` (a case whose measured ``row``
    is 0 is divided by its measured peak instead, so a planned part where none was measured still
    counts), ``median_error`` the median of the same, ``max_bytes`` = max ``|planned - measured|``,
    ``cases`` how many cases measured it, and the one-line ``text`` the pages show."""
    errors, diffs = [], []
    for case in cases:
        states = case.get("states") or {"planned": case["planned"], "measured": case["measured"]}
        planned, measured = states["planned"].get(row), states["measured"].get(row)
        if planned is None or measured is None:
            continue
        diff = abs(planned - measured)
        base = measured or case["measured"].get("peak") or 1
        diffs.append(diff)
        errors.append(diff / base)
    if not errors:
        return {
            "cases": 0,
            "max_error": None,
            "median_error": None,
            "max_bytes": None,
            "text": "not measured",
        }
    worst, n = max(diffs), len(errors)
    if worst == 0:
        text = f"exact in all {n} measured cases"
    elif worst <= EXACT_BYTES:
        text = f"exact to {worst:.0f} bytes in all {n} measured cases"
    else:
        text = (
            f"within {max(errors):.1%} (worst of {n} measured cases, median {statistics.median(errors):.1%})"
        )
    return {
        "cases": n,
        "max_error": max(errors),
        "median_error": statistics.median(errors),
        "max_bytes": worst,
        "text": text,
    }


def stated_accuracy(matrix: dict | None) -> dict:
    """What the pages show of the accuracy ``matrix`` (``load_accuracy``'s shape): ``measured``, where and
    when (``machine``, ``torch``, ``date``), the peak's error distribution from its ``summary`` (fractions:
    ``max``, ``median``, ``p90``; ``within_tolerance`` of ``cases`` within ``tolerance``; the ``worst``
    case), ``peak_text`` (the sentence beside a total) and ``rows``: :func:`row_error` for each
    breakdown row the matrix measures, a reason for the others. With no matrix: ``measured`` false and
    ``peak_text`` saying so."""
    if matrix is None:
        return {"measured": False, "peak_text": NOT_MEASURED, "rows": {}}
    s = matrix["summary"]
    where = f"measured on {matrix['machine']}, torch {matrix['torch']}, {matrix['date']}"
    peak_text = (
        f"peak within {s['max_abs_peak_error']:.1%} (worst of {s['cases']} measured cases, median "
        f"{s['median_abs_peak_error']:.1%}; {s['within_tolerance']} of {s['cases']} within "
        f"{matrix['tolerance']:.0%}), {where}"
    )
    rows = {row: row_error(matrix["cases"], row) for row in MEASURED_ROWS}
    rows |= {row: {"cases": 0, "text": why} for row, why in UNMEASURED_ROWS.items()}
    return {
        "measured": True,
        "machine": matrix["machine"],
        "torch": matrix["torch"],
        "date": matrix["date"],
        "tolerance": matrix["tolerance"],
        "cases": s["cases"],
        "within_tolerance": s["within_tolerance"],
        "max": s["max_abs_peak_error"],
        "median": s["median_abs_peak_error"],
        "p90": s["p90_abs_peak_error"],
        "worst": s["worst"],
        "peak_text": peak_text,
        "rows": rows,
    }


def planner_accuracy() -> dict:
    """:func:`stated_accuracy` of the installed matrix (read on every call: a page shows the file as it
    is)."""
    return stated_accuracy(accuracy.load_accuracy())
