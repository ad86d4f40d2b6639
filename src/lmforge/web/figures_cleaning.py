"""The cleaning trade-off page's figures: the ``sweep.json`` files ``lmforge data sweep`` wrote under RUNS_DIR
(``corpus/sweep.py::run_sweep``), read as they are, and the level this page marks as the optimum.

The optimum is ``corpus/sweep.py::optimum``: the rule ``lmforge data sweep`` itself marks in ``sweep.json``,
``sweep.png`` and its table (weights 1, 1, 1), here with weights the user can change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.web.paths import PathRefused, resolve_under

SWEEP_FILE = "sweep.json"
MAX_DEPTH = 3  # folders below RUNS_DIR searched for sweep.json
HOW_TO = (
    "lmforge data sweep --config RECIPE.toml --out {runs}/sweep --levels 0,20,40,60,80,100 "
    "--reference-classifier MODEL.npz   (or --reference-run RUN; see docs/data.md)"
)


def find_sweeps(root: Path, max_depth: int = MAX_DEPTH) -> list[str]:
    """Paths relative to ``root`` (POSIX) of every ``sweep.json`` at most ``max_depth`` folders below it,
    sorted; links are not followed and a file that resolves outside ``root`` is left out."""
    root = Path(root).resolve()
    found = []
    for folder, dirs, files in os.walk(root):
        depth = len(Path(folder).relative_to(root).parts)
        if depth >= max_depth:
            dirs[:] = []
        dirs.sort()
        if SWEEP_FILE in files:
            rel = (Path(folder) / SWEEP_FILE).relative_to(root).as_posix()
            try:
                resolve_under(root, rel)
            except PathRefused:
                continue
            found.append(rel)
    return sorted(found)


def load_sweep(root: Path, rel: str) -> dict[str, Any]:
    """The content of ``root/rel`` (a ``sweep.json`` under RUNS_DIR); a path outside it, a missing file or
    a file that is not a sweep is a one-line UserError naming ``sweep``."""
    try:
        path = resolve_under(Path(root), rel)
    except PathRefused as exc:
        raise UserError(f"sweep: {exc}") from None
    if path.name != SWEEP_FILE or not path.is_file():
        raise UserError(f"sweep: {rel!r} is not a sweep.json under the runs folder; pick one of the list")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"sweep: {rel}: cannot be read as JSON ({exc})") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) or not result["rows"]:
        raise UserError(f"sweep: {rel}: has no rows; is it the output of lmforge data sweep?")
    return result


def level_knobs(result: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """The threshold each stage's knob had at the ``index``-th level (``result["knobs"]``: stage -> param ->
    one value per level)."""
    out = []
    for stage, params in (result.get("knobs") or {}).items():
        for param, values in params.items():
            value = values[index] if isinstance(values, list) and index < len(values) else values
            out.append({"stage": stage, "param": param, "value": value})
    return out
