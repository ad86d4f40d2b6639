"""``train.micro_batch_size = "auto"``: the largest micro-batch the planner says fits, tokens per step kept."""

from __future__ import annotations

import logging
import tomllib
from dataclasses import replace

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import ConfigError
from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
from lmforge.plan.hardware import cpu
from lmforge.plan.micro_batch import candidates, largest
from lmforge.probes.auto_batch import resolve_micro_batch
from lmforge.recipe import load_config
from lmforge.train.build import accumulation_steps
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

CPU = torch.device("cpu")


def test_candidates_split_the_step_evenly_largest_first():
    assert candidates(4096, 32, 1) == [128, 64, 32, 16, 8, 4, 2, 1]
    assert candidates(4096, 32, 2) == [64, 32, 16, 8, 4, 2, 1]
    assert candidates(96 * 32, 32, 1, multiple_of=4) == [96, 48, 32, 24, 16, 12, 8, 4]
    with pytest.raises(ConfigError, match=r"train\.tokens_per_step"):
        candidates(1000, 32, 1)
    assert largest([8, 4, 2, 1], lambda m: m <= 5) == 4
    assert largest([8, 4], lambda m: False) is None


def _auto(corpus_dir, tmp_path, **extra) -> dict:
    over = tiny_overrides(corpus_dir, tmp_path / "data")
    return {**over, "train.micro_batch_size": "auto", "train.tokens_per_step": 16 * 32, **extra}


def test_auto_picks_the_largest_size_whose_estimate_fits(corpus_dir, tmp_path):
    """Against the planner itself: under a memory cap set between two candidates' estimates, the choice is
    the largest candidate under the margin, and accumulation keeps the tokens of a step."""
    cfg = load_config(None, _auto(corpus_dir, tmp_path, **{"model.d_model": 64, "data.seq_len": 64}))
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"tokens_per_step": 16 * 64})})
    workload = workload_from_config(cfg, "fp32", attention_kind("cpu", "auto", True))
    base = layout_from_config(cfg)
    totals = {m: estimate(workload, replace(base, micro_batch=m), cpu(1.0, 2**40)).total for m in (4, 8, 16)}
    assert totals[4] < totals[8] < totals[16]  # activations grow with the micro-batch
    cap = int((totals[4] + totals[8]) / 2 / 0.8)  # 4 fits under 80% of it, 8 does not
    resolved, smaller, optimizer_bytes = resolve_micro_batch(cfg, CPU, memory_bytes=cap)
    assert resolved.train.micro_batch_size == 4
    assert smaller == [2, 1] and optimizer_bytes > 0
    assert accumulation_steps(resolved) * 4 * 64 == 16 * 64
    roomy, _, _ = resolve_micro_batch(cfg, CPU, memory_bytes=2**40)
    assert roomy.train.micro_batch_size == 16  # everything fits: one micro-batch per step
    tight, _, _ = resolve_micro_batch(cfg, CPU, memory_bytes=int(totals[4] / 10))
    assert tight.train.micro_batch_size == 1  # nothing fits: the smallest, with a warning


def test_a_run_with_auto_trains_and_records_the_size_it_chose(corpus_dir, tmp_path, caplog):
    cfg = load_config(None, _auto(corpus_dir, tmp_path, **{"train.steps": 4, "train.eval_interval": 0}))
    with caplog.at_level(logging.INFO, logger="lmforge"):
        summary = train(cfg, tmp_path / "run", progress_bar=False)
    assert summary["step"] == 4
    chosen = tomllib.loads((tmp_path / "run" / "config.toml").read_text())["train"]["micro_batch_size"]
    assert chosen == 16  # a tiny model on this host: the whole step in one micro-batch
    assert any("micro_batch_size: auto -> 16" in r.getMessage() for r in caplog.records)
    assert summary["tokens_seen"] == 4 * 16 * 32


def test_auto_without_tokens_per_step_is_refused_in_one_line(corpus_dir, tmp_path, capsys, cli_logging):
    with pytest.raises(SystemExit) as done:
        main(["train", "--run-dir", str(tmp_path / "run"), "--train.micro_batch_size=auto"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("lmforge train: error: train.micro_batch_size:") and "tokens_per_step" in err[-1]
    )
    assert not (tmp_path / "run").exists()
