"""No silent minutes: ``lmforge train`` piped (a log file, ``nohup``, CI) prints something at least every
15 seconds from start to end, through every phase the README's first command goes through: reading the
corpus, training the tokenizer, writing the shards, compiling the model (cold: a new machine has no
compile cache), training, evaluating, saving checkpoints and sampling.

The recipe is tiny so that the test is short, but its compilation is a real first one (a fresh
``TORCHINDUCTOR_CACHE_DIR``): 20 s to 2 minutes on 2 CPU cores, shown before as one silent gap
(115 s measured on a busy 2-core machine), and now as a line every few seconds."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli_args, tiny_overrides

MAX_GAP_S = 15.0


def arrivals(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[tuple[float, str]], float, int]:
    """Run ``cmd`` with stdout and stderr merged into one pipe: ``([(arrival s, line)], end s, code)``,
    times from the start."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait()
    return lines, time.monotonic() - start, code


@pytest.mark.slow  # a real first compile: 20 s to 2 minutes on 2 cores
def test_train_piped_prints_something_at_least_every_15_seconds(corpus_dir: Path, tmp_path: Path):
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.compile": True,  # the default compiles
        "train.precision": "auto",  # the default's precision
        "data.seq_len": 64,
        "model.d_model": 64,
        "train.steps": 30,
        "train.eval_interval": 15,
        "train.eval_tokens": 2048,
        "train.checkpoint_interval": 15,
        "train.sample_tokens": 16,
    }
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # a new machine: cold
    cmd = [sys.executable, "-m", "lmforge", "train", "--run-dir", str(tmp_path / "run"), *cli_args(over)]
    lines, end, code = arrivals(cmd, tmp_path, env)
    text = "\n".join(f"{t:6.1f} {line}" for t, line in lines)
    assert code == 0, text
    times = [0.0] + [t for t, _ in lines] + [end]
    gaps = [(b - a, i) for i, (a, b) in enumerate(itertools.pairwise(times))]
    worst, at = max(gaps)
    before = lines[at - 1][1] if at else "(the start)"
    assert worst < MAX_GAP_S, f"{worst:.1f} s without output after: {before}\n{text}"
    # every phase showed itself (the compile as its own phase, with its time at the end)
    for phase in ("data: training a 512-token BPE tokenizer", "data: tokenizing", "compiling the model"):
        assert any(phase in line for _, line in lines), (phase, text)
    assert any("compiling the model: done in" in line for _, line in lines), text
    assert any(line.startswith("sample:") for _, line in lines), text
