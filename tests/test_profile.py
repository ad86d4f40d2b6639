"""``train.profile_steps``: a Chrome trace and the table of the most expensive operators."""

from __future__ import annotations

import json

from lmforge.recipe import load_config
from lmforge.train.launch import train
from tests.conftest import tiny_overrides


def test_profile_steps_write_trace_and_top_ops(corpus_dir, tmp_path, caplog):
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.steps": 4,
        "train.profile_steps": [2, 3],
        "train.eval_tokens": 256,
        "train.sample_tokens": 0,
    }
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO", logger="lmforge"):
        train(load_config(None, over), run_dir, progress_bar=False)
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names
    table = (run_dir / "profile" / "top_ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    rows = [ln for ln in table.splitlines() if ln.strip().startswith(("aten::", "Optimizer.", "autograd::"))]
    assert 0 < len(rows) <= 20
    assert "profile of steps 2..3" in caplog.text
