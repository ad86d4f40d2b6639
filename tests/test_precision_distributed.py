"""Precisions over several processes (torchrun, gloo on CPU): an fp16 Inf/NaN gradient on ONE rank is an
overflow on every rank (the scaler's found-Inf is all-reduced), under DDP, FSDP2 (sharded gradients) and TP;
fp8 under FSDP2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.recipe import load_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.test_distributed import _events, _overrides, launch, losses
from tests.torchrun import torchrun, worker


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp16-dist-cache")


def _scales(run: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["loss_scale"]) for x in lines if "tokens_per_s" in x]


@pytest.mark.distributed
def test_fp16_overflow_on_one_rank_is_skipped_on_all(corpus_dir, cache, tmp_path):
    """guard_worker.py's NaN gradients (the 4th attempt on the last rank, the 7th-9th on rank 0) with a finite loss: four
    overflows, each skipped once on every rank with the scale halved; no guard skip, no rollback; the
    same events and scales as one process."""
    over = _overrides(
        corpus_dir,
        cache,
        **{"train.steps": 12, "train.precision": "fp16", "train.loss_scale.init_scale": 1024.0},
    )
    summaries = {}
    layouts = (
        ("single", 1, {}),
        ("fsdp", 2, {"parallel.dp_shard": 2}),
        ("ddp", 2, {"parallel.dp_replicate": 2}),
        ("tp", 2, {"parallel.tp": 2}),
    )
    for name, nproc, layout in layouts:
        done = torchrun(
            nproc, [worker("guard_worker.py"), str(tmp_path / name), json.dumps({**over, **layout})]
        )
        assert done.returncode == 0, done.stderr[-4000:]
        text = done.stdout.split("SUMMARY ", 1)[1]
        summaries[name] = json.JSONDecoder().raw_decode(text)[0]  # other ranks may print on the same line
    for name, _, _ in layouts:
        assert summaries[name] == {"skipped_steps": 4, "rollbacks": 0, "step": 12}, (name, summaries)
        assert _events(tmp_path / name) == [(4, "loss_scale_overflow")] + [(6, "loss_scale_overflow")] * 3
        scales = _scales(tmp_path / name)
        want = [(s, 1024.0) for s in (1, 2, 3)] + [(4, 512.0), (5, 512.0)] + [(s, 64.0) for s in range(6, 13)]
        assert scales == want, (name, scales)


@pytest.mark.distributed
def test_fp8_under_fsdp_trains_like_one_process(corpus_dir, cache, tmp_path):
    """fp8 (emulated) with FSDP2 gathering BF16 parameters into the float8 layers: close to the same
    fp8 run in one process, and the master weights stay FP32."""
    over = _overrides(corpus_dir, cache, **{"train.precision": "fp8", "model.d_model": 64, "train.steps": 6})
    train(load_config(None, over), tmp_path / "single", progress_bar=False)
    launch(2, tmp_path / "fsdp", {**over, "parallel.dp_shard": 2})
    got, want = losses(tmp_path / "fsdp"), losses(tmp_path / "single")
    assert sorted(got) == list(range(1, 7))
    assert all(got[s] == pytest.approx(want[s], rel=2e-2) for s in got), (got, want)
    assert got[6] < got[1]
    state = load_checkpoint(latest_checkpoint(tmp_path / "fsdp"))
    assert all(v.dtype == torch.float32 for v in state["model"].values())
