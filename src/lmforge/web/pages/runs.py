"""The training dashboard: the runs under RUNS_DIR with their status, and the curves of the selected runs
(loss, learning rate, gradient and parameter norms, attention entropy per layer, downstream task scores)
overlaid, one colour per run, with the events (the guard's, early stopping, task regressions), the
mixture's phase changes and the end of the LR warmup marked on the loss curve, and the config keys in
which the selected runs differ.

Everything is read by lmforge's own readers: the record kinds of ``lmforge.report.runs``, the panels of
``lmforge plot`` (``report/plots.py``), ``lmforge compare``'s rows and config differences
(``report/compare.py``), the warmup of ``optim/schedules.py``. A running run is followed by polling
``/api/runs/metrics`` with the byte offset of ``metrics.jsonl`` reached so far (``web/run_files.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flask import Blueprint, current_app, render_template, request

from lmforge.recipe import load_saved_config
from lmforge.report.compare import config_of, differences, run_row
from lmforge.report.plots import FEW_POINTS, PANELS, Panel, panel_keys
from lmforge.report.runs import KINDS, RunRecords, finite, open_run, record_kind
from lmforge.web.api import BadInput, arg_int, json_api
from lmforge.web.moe_load import moe_load
from lmforge.web.paths import PathRefused
from lmforge.web.registry import Page
from lmforge.web.run_files import RowCache, last_write, list_runs, read_new_records, run_folder, shown_status

blueprint = Blueprint("runs", __name__)
CHARTS = ("loss", "lr", "norms", "attn_entropy", "tasks")  # the panels of report/plots.py this page draws
MAX_DIFF_RUNS = 12


def charts() -> list[Panel]:
    """The panels of ``lmforge plot`` that the page draws, in :data:`CHARTS` order."""
    by_name = {p.name: p for p in PANELS}
    return [by_name[name] for name in CHARTS]


def split_records(path: Path, records: list[dict[str, Any]]) -> RunRecords:
    """``records`` as a :class:`RunRecords` of ``path`` (kinds as ``lmforge.report.runs`` tells them)."""
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for record in records:
        kind = record_kind(record)
        if kind is not None:
            by_kind[kind].append(record)
    return RunRecords(path, by_kind)


def chart_series(run: RunRecords) -> dict[str, list[dict[str, Any]]]:
    """Per chart, the lines ``run``'s records give it: ``{"key": "<kind>:<metric key>", "label", "x":
    steps, "y": values}`` (finite values only), the lines of :func:`lmforge.report.plots.panel_keys`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for panel in charts():
        lines = []
        for curve, key, label in panel_keys(panel, run):
            steps, values = run.series(curve.kind, key)
            if steps:
                lines.append({"key": f"{curve.kind}:{key}", "label": label, "x": steps, "y": values})
        out[panel.name] = lines
    return out


def phase_changes(step_records: list[dict[str, Any]], previous: int | None) -> list[dict[str, Any]]:
    """The step records at which a mixture's ``phase`` changes value (``previous``: the phase of the last
    record before these, None when there was none). Each: ``{"step", "kind": "phase", "label"}``; the
    change is marked at the first record of the new phase (the exact step with ``log_interval = 1``)."""
    out = []
    for record in step_records:
        phase = record.get("phase")
        if not isinstance(phase, int) or isinstance(phase, bool):
            continue
        if previous is not None and phase != previous:
            name = record.get("phase_name") or f"phase {phase}"
            out.append({"step": int(record["step"]), "kind": "phase", "label": f"phase: {name}"})
        previous = phase
    return out


def last_phase(step_records: list[dict[str, Any]], previous: int | None) -> int | None:
    """The ``phase`` of the last step record that has one (``previous`` when none does)."""
    for record in reversed(step_records):
        phase = record.get("phase")
        if isinstance(phase, int) and not isinstance(phase, bool):
            return phase
    return previous


def event_marks(run: RunRecords) -> list[dict[str, Any]]:
    """The run's events but checkpoints (``RunRecords.events``: guard skips, rollbacks, loss-scale
    overflows, early stop...) as marks: ``{"step", "kind": "event", "label": event name, "loss": the
    event's own loss or None, "text": its other fields}``."""
    out = []
    for event in run.events():
        fields = {k: v for k, v in event.items() if k not in ("step", "event")}
        loss = fields.get("loss")
        out.append(
            {
                "step": int(event["step"]),
                "kind": "event",
                "label": str(event["event"]),
                "loss": float(loss) if finite(loss) else None,
                "text": ", ".join(f"{k}={v}" for k, v in fields.items()),
            }
        )
    return out


def warmup_mark(run: Path) -> list[dict[str, Any]]:
    """The end of the run's linear LR warmup: step ``W = warmup_steps(schedule.warmup, train.steps)``
    (``optim/schedules.py``; the step record of step W is the first at the peak multiplier ``W / W``).
    None for no warmup, and for ``one_cycle`` / ``plateau`` whose rise is not that warmup."""
    from lmforge.optim.schedules import warmup_steps

    cfg = load_saved_config(run / "config.toml")
    if cfg.schedule.name in ("one_cycle", "plateau"):
        return []
    w = warmup_steps(cfg.schedule.warmup, cfg.train.steps)
    return [{"step": w, "kind": "warmup", "label": "warmup ends"}] if 0 < w <= cfg.train.steps else []


def table_row(rel: str, path: Path, now: float | None = None) -> dict[str, Any]:
    """One run's row: ``lmforge compare``'s figures (steps, best validation loss and its step...), the
    last training loss, and the status shown (:func:`lmforge.web.run_files.shown_status`)."""
    run = open_run(path)
    row = run_row(run)
    losses = run.series("step", "loss")[1]
    row.update(
        run=rel,
        status=shown_status(run.status, last_write(path), time.time() if now is None else now),
        last_loss=losses[-1] if losses else None,
    )
    row.pop("path", None)  # the absolute path stays on the server
    return row


_rows = RowCache()


def _root() -> Path:
    return current_app.config["RUNS_DIR"]


def _run_param(rel: str | None) -> tuple[str, Path]:
    if not rel:
        raise BadInput(
            "run: missing; give a run folder relative to the runs folder (runs listed by /api/runs)"
        )
    try:
        return rel, run_folder(_root(), rel)
    except PathRefused as exc:
        raise BadInput(f"run: {exc}; give a run folder relative to the runs folder") from None


@blueprint.get("/runs")
def runs_page():
    return render_template(
        "runs.html",
        title="Training dashboard",
        defaults={
            "charts": [
                {"name": p.name, "title": p.title, "ylabel": p.ylabel, "log": p.log} for p in charts()
            ],
            "few_points": FEW_POINTS,  # a series with fewer points is drawn with markers, as lmforge plot does
        },
    )


@blueprint.get("/api/runs")
@json_api
def runs_api() -> dict[str, Any]:
    """Every run under RUNS_DIR with its row (status, steps, last loss, best validation loss)."""
    root = _root()
    rows = []
    for rel in list_runs(root):
        path = run_folder(root, rel)
        row = _rows.get(path, lambda p, rel=rel: table_row(rel, p))
        written = last_write(path)
        if row["status"] in ("running", "incomplete"):  # a running row goes stale by time alone
            row = dict(row, status=shown_status("running-or-incomplete", written, time.time()))
        rows.append(dict(row, written_at=written))
    return {"runs": rows}


@blueprint.get("/api/runs/metrics")
@json_api
def metrics_api() -> dict[str, Any]:
    """The records of the run ``run`` written after byte ``offset`` of its ``metrics.jsonl``, as chart
    lines and marks. ``file`` (the identity returned before) and ``phase`` (the last phase seen, -1: none)
    carry the reader's state. ``start`` in the answer: it begins at byte 0 (a first read, or ``reset``: the
    file was replaced), so it replaces what the page had of this run instead of extending it."""
    rel, path = _run_param(request.args.get("run"))
    offset = arg_int("offset", 0, lo=0)
    file = request.args.get("file", "")
    if file and not file.isdigit():
        raise BadInput(f"file: {file!r} is not a file identity from an earlier answer; leave it out")
    previous = arg_int("phase", -1, lo=-1)
    chunk = read_new_records(path / "metrics.jsonl", offset, file)
    run = split_records(path, chunk.records)
    before = None if chunk.reset or previous < 0 else previous
    marks = event_marks(run) + phase_changes(run.records["step"], before)
    start = chunk.reset or offset == 0
    if start:
        marks += warmup_mark(path)
    size = (path / "metrics.jsonl").stat().st_size if (path / "metrics.jsonl").is_file() else 0
    phase = last_phase(run.records["step"], before)
    return {
        "run": rel,
        "offset": chunk.offset,
        "file": chunk.file,
        "reset": chunk.reset,
        "start": start,
        "more": chunk.offset < size and bool(chunk.records),
        "phase": -1 if phase is None else phase,
        "series": chart_series(run),
        "marks": sorted(marks, key=lambda m: m["step"]),
    }


@blueprint.get("/api/runs/moe-load")
@json_api
def moe_load_api() -> dict[str, Any]:
    """The expert load per MoE layer at each logged step of the run ``run`` (``web/moe_load.py``): the
    heatmap of static/runs_moe.js. Empty lists for a dense run."""
    rel, path = _run_param(request.args.get("run"))
    return {"run": rel, **moe_load(open_run(path))}


@blueprint.get("/api/runs/diff")
@json_api
def diff_api() -> dict[str, Any]:
    """The config keys (dotted) in which the runs ``run`` (repeated) differ, each with its value per run:
    ``lmforge compare``'s differences of the runs' resolved configs."""
    rels = request.args.getlist("run")
    if not rels:
        raise BadInput("run: give one or more run folders (run=a&run=b)")
    if len(rels) > MAX_DIFF_RUNS:
        raise BadInput(f"run: {len(rels)} runs; give at most {MAX_DIFF_RUNS}")
    paths = [_run_param(rel)[1] for rel in rels]
    return {"runs": rels, "differences": differences([config_of(RunRecords(p)) for p in paths])}


PAGE = Page(
    "runs",
    "Training dashboard",
    10,
    "runs and their status; live loss, learning-rate, norm, attention-entropy and task-score curves, "
    "overlaid, with guard events, task regressions, phase changes and config differences",
    blueprint,
    group="runs",
)
