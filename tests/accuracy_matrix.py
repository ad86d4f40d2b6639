"""An accuracy matrix with figures the tests choose, installed where ``plan/accuracy.py::load_accuracy``
reads it (its ``PATH``, moved to a temporary folder), so the pages' accuracy is checked against figures
typed here rather than against the repo's measured matrix."""

from __future__ import annotations

import json
from pathlib import Path

import lmforge.plan.accuracy

GIB = 2**30


def case(name: str, planned: dict, measured: dict, phase: str = "a phase") -> dict:
    keys = ("parameters", "gradients", "optimizer states")
    return {
        "states": {"planned": {k: planned[k] for k in keys}, "measured": {k: measured[k] for k in keys}},
        "name": name,
        "processes": 1,
        "flags": {"train.precision": "fp32"},
        "layout": "one process",
        "precision": "fp32",
        "optimizer": "adamw",
        "planned": {**planned, "phase": phase},
        "measured": measured,
        "peak_error": planned["peak"] / measured["peak"] - 1,
    }


def parts(params, grads, optim, acts, temps) -> dict:
    return {
        "parameters": params,
        "gradients": grads,
        "optimizer states": optim,
        "activations": acts,
        "temporaries": temps,
        "peak": params + grads + optim + acts + temps,
    }


# Two cases whose model states the expected texts below are worked out from by hand: parameters and
# optimizer states equal, gradients 8 bytes apart in one case. Activations and temporaries are parts of the
# peak, which the pages refer to (the trackers' categories are not the planner's rows). The summary is
# the matrix's own (26 cases).
MATRIX = {
    "machine": "Test box, 2 cores",
    "torch": "2.13.0",
    "date": "2026-11-20",
    "tolerance": 0.05,
    "cases": [
        case(
            "one",
            parts(GIB, GIB, 2 * GIB, 2.6 * GIB, 0.5 * GIB),
            parts(GIB, GIB, 2 * GIB, 2.5 * GIB, 0.5 * GIB),
        ),
        case(
            "two",
            parts(GIB, GIB + 8, 2 * GIB, 2.525 * GIB, 0.02 * GIB),
            parts(GIB, GIB, 2 * GIB, 2.5 * GIB, 0),
        ),
    ],
    "summary": {
        "cases": 26,
        "within_tolerance": 25,
        "median_abs_peak_error": 0.008,
        "p90_abs_peak_error": 0.024,
        "max_abs_peak_error": 0.031,
        "worst": "zero3-bf16-gqa",
    },
}
PEAK_TEXT = (
    "peak within 3.1% (worst of 26 measured cases, median 0.8%; 25 of 26 within 5%), "
    "measured on Test box, 2 cores, torch 2.13.0, 2026-11-20"
)
ROW_TEXTS = {
    "parameters": "exact in all 2 measured cases",
    "gradients": "exact to 8 bytes in all 2 measured cases",
    "optimizer states": "exact in all 2 measured cases",
    "activations": "in the peak's accuracy: the trackers file a step's buffers under other names than the "
    "planner's rows (docs/memory-accuracy.md)",
    "temporaries": "in the peak's accuracy: the trackers file a step's buffers under other names than the "
    "planner's rows (docs/memory-accuracy.md)",
}


def install(monkeypatch, folder: Path, matrix: dict | None = MATRIX) -> Path:
    """Make ``load_accuracy`` read ``folder/accuracy.json``: ``matrix`` written there, or no file when
    None. Returns the file's path (delete it to take the matrix away while a page is open)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "accuracy.json"
    monkeypatch.setattr(lmforge.plan.accuracy, "PATH", path)
    if matrix is not None:
        path.write_text(json.dumps(matrix))
    return path
