"""The built-in default run, end to end (about 10 minutes on 2 CPU cores): `pytest -m slow`."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_default_run_beats_the_unigram_baseline(default_run):
    run, result = default_run
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    print(json.dumps(summary, indent=1))
    assert summary["val_loss"] <= 0.55 * summary["unigram_loss"]
    assert "sample:" in result.stdout
