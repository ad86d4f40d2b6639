"""The post-training demonstration of docs/post-training.md on the built-in default run (`pytest -m slow`):
SFT lowers the held-out response loss, DPO separates the right docstring from another one on held-out
modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sft_then_dpo_on_the_default_run(default_run, tmp_path):
    run, trained = default_run
    assert trained.returncode == 0, trained.stderr[-2000:]
    out = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "post_training.py"), str(run), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"]["splits"]["train"] and report["pairs"]["splits"]["val"]
    assert report["sft_heldout_loss_after"] < 0.8 * report["sft_heldout_loss_before"]
    after = report["dpo_heldout_after"]
    assert after["val_rewards/accuracies"] > ACCURACY and after["val_rewards/margins"] > 0
    assert len(report["samples"]["after_dpo"]) == 5
