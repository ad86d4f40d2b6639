"""The planner's measured accuracy: ``plan/accuracy.json``, written by ``benchmarks/planner_accuracy.py``
(each case of the matrix planned by ``plan/estimate.py`` and measured by ``probes/step_memory.py``), read
here for whoever states the planner's accuracy beside its figures (the web pages, the docs).

The file's shape::

    {"machine", "torch", "date", "tolerance",
     "cases": [{"name", "processes", "flags", "layout", "precision", "optimizer",
                "planned": {"parameters", "gradients", "optimizer states", "activations", "temporaries",
                            "peak", "phase"},
                "measured": {... the same rows, "peak"}, "peak_error"}],
     "summary": {"cases", "within_tolerance", "median_abs_peak_error", "p90_abs_peak_error",
                 "max_abs_peak_error", "worst"}}

``peak_error`` is ``planned peak / measured peak - 1``, the planned peak being the tracked part
(``total - overhead``). Nothing here computes a figure: a missing or unreadable file is None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).with_name("accuracy.json")


def load_accuracy(path: Path | None = None) -> dict | None:
    """The accuracy file (default: the one shipped beside this module) as a dict; None when it is missing
    or not a JSON object with ``cases`` and ``summary``."""
    try:
        data = json.loads((path or PATH).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list) or "summary" not in data:
        return None
    return data


@dataclass(frozen=True)
class AccuracySummary:
    """The matrix in a few figures: how many cases, how many within ``tolerance`` on the peak, the median,
    90th percentile and largest ``|peak error|`` (fractions: 0.05 is 5%), the worst case's name, and where
    and when it was measured."""

    cases: int
    within_tolerance: int
    tolerance: float
    median_abs_peak_error: float
    p90_abs_peak_error: float
    max_abs_peak_error: float
    worst: str
    machine: str
    torch: str
    date: str


def accuracy_summary(data: dict | None = None) -> AccuracySummary | None:
    """:class:`AccuracySummary` of ``data`` (default: :func:`load_accuracy`'s); None without a file."""
    data = load_accuracy() if data is None else data
    if data is None:
        return None
    s = data["summary"]
    return AccuracySummary(
        cases=int(s["cases"]),
        within_tolerance=int(s["within_tolerance"]),
        tolerance=float(data.get("tolerance", 0.05)),
        median_abs_peak_error=float(s["median_abs_peak_error"]),
        p90_abs_peak_error=float(s["p90_abs_peak_error"]),
        max_abs_peak_error=float(s["max_abs_peak_error"]),
        worst=str(s["worst"]),
        machine=str(data.get("machine", "")),
        torch=str(data.get("torch", "")),
        date=str(data.get("date", "")),
    )
