"""Early stopping (``train/callbacks/evaluation.py::EarlyStopping``): the run ends after
``train.early_stop_patience`` evaluations without a new best validation loss, keeps the best checkpoint
out of rotation and says so."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmforge.errors import ConfigError
from lmforge.recipe import load_config
from lmforge.train.callbacks import Callback
from lmforge.train.checkpoint import list_checkpoints
from lmforge.train.launch import train
from tests.conftest import tiny_overrides


class FreezeAfter(Callback):
    """From step ``step`` on the learning rate is 0: the weights, hence the validation loss, stay put."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, result):
        if trainer.progress.step >= self.step:
            trainer.lr_scale = 0.0


def test_stops_after_patience_and_keeps_the_best(corpus_dir, tmp_path):
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.steps": 20,
        "train.eval_interval": 2,
        "train.eval_tokens": 256,
        "train.early_stop_patience": 2,
        "train.checkpoint_interval": 0,
        "train.keep_checkpoints": 1,
        "train.log_interval": 2,
        "train.sample_tokens": 0,
        "schedule.warmup": 1,
    }
    run_dir = tmp_path / "run"
    summary = train(load_config(None, over), run_dir, progress_bar=False, callbacks=[FreezeAfter(4)])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(x["step"], x["val_loss"]) for x in lines if "val_loss" in x]
    assert [s for s, _ in evals] == [2, 4, 6, 8]  # 6 and 8 do not improve on 4: stop at 8, evaluated once
    assert evals[1][1] < evals[0][1] and evals[2][1] == evals[3][1] == evals[1][1]
    (event,) = [x for x in lines if x.get("event") == "early_stop"]
    assert event["step"] == 8 and event["best_step"] == 4 and event["evaluations_without_improvement"] == 2
    assert not any(x.get("step", 0) > 8 for x in lines)
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for s in (summary, on_disk):
        assert s["early_stopped"] is True and s["step"] == 8
        assert s["best_step"] == 4 and s["best_val_loss"] == evals[1][1] == s["val_loss"]
    # keep_checkpoints = 1 keeps the newest (the end, step 8) and the best (step 4, written when it was best)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000004", "step_00000008"]
    best = json.loads((run_dir / "best.json").read_text())
    assert best == {"step": 4, "val_loss": evals[1][1], "checkpoint": "checkpoints/step_00000004"}


def test_patience_needs_evaluations(corpus_dir, tmp_path):
    over = tiny_overrides(corpus_dir, tmp_path / "data")
    with pytest.raises(ConfigError, match=r"train\.early_stop_patience: .*train\.eval_interval above 0"):
        load_config(None, over | {"train.early_stop_patience": 3, "train.eval_interval": 0})
    args = ["train", "--train.early_stop_patience=3", "--train.eval_interval=0"]
    result = subprocess.run(
        [sys.executable, "-m", "lmforge", *args], cwd=tmp_path, capture_output=True, text=True
    )
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "train.early_stop_patience" in lines[0], (
        result.stderr
    )
    assert not (tmp_path / "runs").exists()
