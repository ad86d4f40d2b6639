"""``train.deterministic``: on CPU in FP32, two fresh runs in separate processes, and a run killed with
SIGKILL and resumed, end with bitwise equal losses and parameters, eager and compiled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.data.prepare import prepare_data
from lmforge.recipe import load_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.conftest import cli_args, same_value, tiny_overrides

STEPS = 40


def _overrides(corpus_dir: Path, cache: Path, compiled: bool) -> dict:
    over = tiny_overrides(corpus_dir, cache)
    over.update(
        {
            "train.deterministic": True,
            "train.compile": compiled,
            "train.steps": STEPS,
            "train.log_interval": 1,
            "train.eval_interval": 0,
            "train.checkpoint_interval": 10,
            "train.sample_tokens": 0,
        }
    )
    return over


def _start(run: Path, over: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lmforge", "train", "--run-dir", str(run), *extra, *cli_args(over)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run.parent)


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]


def _losses(run: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["loss"]) for x in lines if "loss" in x and "event" not in x]


def _final(run: Path) -> dict:
    return load_checkpoint(latest_checkpoint(run))


def _assert_bitwise_equal(a: Path, b: Path) -> None:
    assert _losses(a) == _losses(b)  # every step's loss, to the last bit (JSON floats round-trip)
    sa, sb = _final(a), _final(b)
    assert sa["progress"]["step"] == sb["progress"]["step"] == STEPS
    for key, value in sa["model"].items():
        assert torch.equal(value, sb["model"][key]), key
    for k, value in sa["optimizer"].items():
        assert same_value(value, sb["optimizer"][k]), k


@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_fresh_runs_and_a_killed_and_resumed_run_are_bitwise_equal(corpus_dir, tmp_path, compiled):
    over = _overrides(corpus_dir, tmp_path / "data", compiled)
    prepare_data(load_config(None, over).data)  # the three runs share the prepared data
    first, second, killed = tmp_path / "first", tmp_path / "second", tmp_path / "killed"
    _finish(_start(first, over))
    _finish(_start(second, over))
    _assert_bitwise_equal(first, second)

    proc = _start(killed, over)
    deadline = time.monotonic() + 600
    while not (killed / "checkpoints" / "step_00000010").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, (
            "the run ended before its first checkpoint"
        )
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert latest_checkpoint(killed).name != f"step_{STEPS:08d}"  # killed mid-run
    _finish(_start(killed, over, "--resume"))
    _assert_bitwise_equal(first, killed)
