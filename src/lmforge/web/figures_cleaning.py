"""The cleaning trade-off page's figures: the ``sweep.json`` files ``lmforge data sweep`` wrote under RUNS_DIR
(``cleaning_sweep.run_sweep``), read as they are, and the level this page marks as the optimum.

``lmforge data sweep`` measures and marks no optimum (``docs/data.md`` defines none), so the page marks one
by a stated rule, with weights the user can change (all 1 by default). For each level ``i`` every curve is
scaled to [0, 1] across the levels, ``c_hat_i = (c_i - min c) / (max c - min c)`` (1 when all are equal):

* size: ``tokens`` kept;
* quality: ``quality_mean`` under the sweep's reference, flipped (``1 - c_hat``) when lower is better
  (perplexity);
* diversity: ``distinct_ngrams_at_k`` (distinct n-grams per word at the equal size ``K``).

``score_i = (w_s size_i + w_q quality_i + w_d diversity_i) / (w_s + w_q + w_d)``; the optimum is the level
of the highest score (a tie goes to the more lenient level, which keeps more). A level with a missing
figure (no document kept) has no score.
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


def scaled(values: list[float | None]) -> list[float | None]:
    """``(v - min) / (max - min)`` over the non-missing values (1 for each when they are all equal)."""
    present = [v for v in values if v is not None]
    if not present:
        return [None] * len(values)
    lo, hi = min(present), max(present)
    return [None if v is None else (1.0 if hi == lo else (v - lo) / (hi - lo)) for v in values]


def optimum(
    rows: list[dict[str, Any]], higher_is_better: bool, weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
) -> dict[str, Any]:
    """The scaled size, quality and diversity of each row, its score and the optimum's index (module
    docstring); ``index`` is None when no level has every figure or every weight is 0."""
    size = scaled([r.get("tokens") for r in rows])
    quality = scaled([r.get("quality_mean") for r in rows])
    if not higher_is_better:
        quality = [None if q is None else 1.0 - q for q in quality]
    diversity = scaled([r.get("distinct_ngrams_at_k") for r in rows])
    ws, wq, wd = weights
    total = ws + wq + wd
    scores: list[float | None] = []
    for s, q, d in zip(size, quality, diversity, strict=True):
        ok = total > 0 and None not in (s, q, d)
        scores.append((ws * s + wq * q + wd * d) / total if ok else None)
    best = None
    for i, sc in enumerate(scores):
        if sc is not None and (best is None or sc > scores[best]):
            best = i
    return {"size": size, "quality": quality, "diversity": diversity, "score": scores, "index": best}


def level_knobs(result: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """The threshold each stage's knob had at the ``index``-th level (``result["knobs"]``: stage -> param ->
    one value per level)."""
    out = []
    for stage, params in (result.get("knobs") or {}).items():
        for param, values in params.items():
            value = values[index] if isinstance(values, list) and index < len(values) else values
            out.append({"stage": stage, "param": param, "value": value})
    return out
