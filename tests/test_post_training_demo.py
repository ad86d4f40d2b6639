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
# a shorter chain than docs/post-training.md's (about 6 minutes on 2 cores instead of about 20): a third of
# the SFT steps, 60 DPO steps on 480 pairs at a 6x larger rate (at dpo's 5e-5 the held-out accuracy after 60
# steps was 0.515, too near chance for a check), 200 held-out records
QUICK = [
    "--sft-steps",
    "100",
    "--dpo-steps",
    "60",
    "--dpo-pairs",
    "480",
    "--dpo-lr",
    "3e-4",
    "--val-records",
    "200",
]


@pytest.mark.slow
def test_sft_then_dpo_on_the_default_run(default_run, tmp_path):
    run, trained = default_run
    assert trained.returncode == 0, trained.stderr[-2000:]
    out = tmp_path / "demo"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "post_training.py"),
            str(run),
            "--out",
            str(out),
            *QUICK,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(done.stdout)
    report = json.loads((out / "report.json").read_text())
    assert report["pairs"]["splits"]["train"] and report["pairs"]["splits"]["val"]
    assert report["sft_heldout_loss_after"] < report["sft_heldout_loss_before"]
    before, after = report["dpo_heldout_before"], report["dpo_heldout_after"]
    # step 0 is the reference: no margin yet; the margin is beta times differences of equal FP32 log-
    # probabilities (~30 in size: ulp 1.9e-6), so 1e-4 is FP32 room, not a measured figure
    assert abs(before["val_rewards/margins"]) < 1e-4
    # the full chain measured about 0.6 on this 2-core CPU (the target of 0.9 is not reached)
    assert after["val_rewards/accuracies"] > 0.5 and after["val_rewards/margins"] > 0
    assert len(report["samples"]["after_dpo"]) == 5
