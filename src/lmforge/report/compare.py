"""``lmforge compare``: runs side by side (losses, tokens, time, throughput, size), their downstream task
scores (the newest ``RUN/eval/tasks_step_N.json`` that ``lmforge eval --tasks`` wrote) and the config
keys in which they differ."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.recipe import load_saved_config
from lmforge.report.runs import RunRecords, finite

COLUMNS = (
    ("run", "run"),
    ("status", "status"),
    ("steps", "steps"),
    ("final_val_loss", "final val"),
    ("best_val_loss", "best val"),
    ("best_val_step", "at step"),
    ("tokens_seen", "tokens"),
    ("wall_time_s", "wall s"),
    ("tokens_per_s", "tokens/s"),
    ("parameters", "params"),
)


def run_row(run: RunRecords) -> dict[str, Any]:
    """One run's figures: ``summary.json``'s where the run finished, else the newest records'.

    ``tokens_per_s`` is the mean of the step records' ``tokens_per_s`` (training time only); the best
    validation loss and its step are the minimum over the evaluation records.
    """
    s = run.summary or {}
    evals = run.series("eval", "val_loss")
    steps = run.series("step", "tokens_seen")
    rates = run.series("step", "tokens_per_s")[1]
    best = min(range(len(evals[1])), key=lambda i: evals[1][i]) if evals[1] else None
    return {
        "run": run.name,
        "path": str(run.path),
        "status": run.status,
        "steps": s.get("step", run.last_step),
        "final_val_loss": s.get("val_loss", evals[1][-1] if evals[1] else None),
        "best_val_loss": evals[1][best] if best is not None else None,
        "best_val_step": evals[0][best] if best is not None else None,
        "tokens_seen": s.get("tokens_seen", steps[1][-1] if steps[1] else None),
        "wall_time_s": s.get("wall_time_s"),
        "tokens_per_s": sum(rates) / len(rates) if rates else None,
        "parameters": s.get("parameters"),
        "tasks": task_scores(run.path),
    }


def task_scores(run_dir: Path) -> dict[str, dict[str, Any]]:
    """``{task: {"metric", "value", "stderr", "n", "step"}}`` from the newest readable
    ``RUN/eval/tasks_step_N.json`` (empty when the run has none)."""
    files = sorted(
        (run_dir / "eval").glob("tasks_step_*.json"),
        key=lambda p: int(p.stem.rsplit("_", 1)[1]) if p.stem.rsplit("_", 1)[1].isdigit() else -1,
    )
    for path in reversed(files):
        try:
            saved = json.loads(path.read_text())
            return {
                name: {k: r.get(k) for k in ("metric", "value", "stderr", "n")} | {"step": saved["step"]}
                for name, r in saved["tasks"].items()
            }
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
            continue
    return {}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested dict (``{"a": {"b": 1}} -> {"a.b": 1}``); lists stay whole values."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def config_of(run: RunRecords) -> dict[str, Any]:
    """The run's resolved config (its ``config.toml`` over the defaults), flattened to dotted keys."""
    return flatten(load_saved_config(run.path / "config.toml").model_dump(mode="json"))


def differences(configs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The dotted keys whose values are not the same in every config, sorted, each with its value per
    config (None where a config lacks the key)."""
    keys = sorted({k for c in configs for k in c})
    out = {}
    for key in keys:
        values = [c.get(key) for c in configs]
        if any(json.dumps(v, sort_keys=True) != json.dumps(values[0], sort_keys=True) for v in values):
            out[key] = values
    return out


def compare(runs: list[RunRecords]) -> dict[str, Any]:
    """``{"runs": [row per run], "differences": {key: [value per run]}}``."""
    rows = [run_row(r) for r in runs]
    if len({row["run"] for row in rows}) < len(rows):  # same folder name in two places: show the paths
        for row in rows:
            row["run"] = row["path"]
    return {"runs": rows, "differences": differences([config_of(r) for r in runs])}


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key in ("final_val_loss", "best_val_loss") and finite(value):
        return f"{value:.4f}"
    if key == "wall_time_s" and finite(value):
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return value if isinstance(value, str) else json.dumps(value)


def table_text(result: dict[str, Any]) -> str:
    """The comparison as aligned plain text: one row per run, then the differing config keys."""
    head = [title for _, title in COLUMNS]
    rows = [[_cell(row[key], key) for key, _ in COLUMNS] for row in result["runs"]]
    lines = _aligned([head, *rows], left={0, 1})
    lines += _task_lines(result["runs"])
    diffs = result["differences"]
    lines.append("")
    if not diffs:
        lines.append("key config differences: none")
        return "\n".join(lines)
    lines.append("key config differences:")
    names = [row["run"] for row in result["runs"]]
    table = [["key", *names]] + [[k, *(_cell(v, k) for v in vs)] for k, vs in diffs.items()]
    lines += ["  " + line for line in _aligned(table, left=set(range(len(names) + 1)))]
    return "\n".join(lines)


def _task_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The task scores as a table (task, metric, then ``value ± stderr`` per run), or nothing."""
    names = sorted({(t, r["metric"]) for run in runs for t, r in run["tasks"].items()})
    if not names:
        return []

    def cell(run: dict[str, Any], task: str, metric: str) -> str:
        r = run["tasks"].get(task)
        if r is None or r["metric"] != metric or not finite(r["value"]):
            return "-"
        return f"{r['value']:.4f}" + (f" ± {r['stderr']:.4f}" if finite(r["stderr"]) else "")

    table = [["task", "metric", *(run["run"] for run in runs)]]
    table += [[t, m, *(cell(run, t, m) for run in runs)] for t, m in names]
    return ["", "task scores (lmforge eval --tasks, newest step):"] + [
        "  " + line for line in _aligned(table, left={0, 1})
    ]


def _aligned(table: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in table
    ]
