"""The expert load of an MoE run as the training dashboard's heatmap draws it: for every logged step, the
tokens each expert of each MoE layer took (the step records' ``moe/layer.<i>/load`` lists, written by
``model/moe.py::moe_metrics``; docs/metrics.md), as a layer x expert matrix. Nothing is computed here
that the run did not log: the matrix is those lists, stacked."""

from __future__ import annotations

import re
from typing import Any

from lmforge.report.runs import RunRecords, finite

LOAD_KEY = re.compile(r"moe/layer\.(\d+)/load")


def moe_load(run: RunRecords) -> dict[str, Any]:
    """``{"layers": [block indices], "experts": E, "steps": [...], "load": [[[tokens per expert] per
    layer] per step], "imbalance": [[max / mean per layer] per step]}`` from ``run``'s step records that
    carry a load list for every MoE layer (empty lists for a dense run)."""
    records = run.records.get("step", [])
    layers = sorted({int(m[1]) for r in records for k in r if (m := LOAD_KEY.fullmatch(k))})
    out: dict[str, Any] = {"layers": layers, "experts": 0, "steps": [], "load": [], "imbalance": []}
    for record in records:
        rows = [record.get(f"moe/layer.{i}/load") for i in layers]
        if not layers or not all(_loads(row) for row in rows):
            continue
        out["steps"].append(int(record["step"]))
        out["load"].append(rows)
        out["imbalance"].append([record.get(f"moe/layer.{i}/imbalance") for i in layers])
        out["experts"] = max(out["experts"], *(len(row) for row in rows))
    return out


def _loads(row: Any) -> bool:
    return isinstance(row, list) and bool(row) and all(finite(v) for v in row)
