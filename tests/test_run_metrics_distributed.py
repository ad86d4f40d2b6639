"""The run metrics under torchrun (gloo on CPU): MFU counts every process; the gradient noise scale is
measured under DDP (the first micro-batch's gradient is whole and rank-local) and skipped, with its reason,
under FSDP2 (which reduces and shards the gradient of every micro-batch)."""

from __future__ import annotations

import json

import pytest

from lmforge.plan.flops import model_flops_per_token
from lmforge.recipe import load_config
from tests.conftest import tiny_overrides
from tests.test_distributed import launch
from tests.test_run_metrics import _check_noise_scale

pytestmark = pytest.mark.distributed


def _over(corpus_dir, tmp_path, **extra) -> dict:
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.steps": 4,
        "train.tokens_per_step": 16 * 32,  # 2 micro-batches of 4 sequences on each of 2 ranks
        "train.log_interval": 2,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
        "train.sample_tokens": 0,
    }
    return over | extra


def _records(run_dir) -> list[dict]:
    return [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "tokens_per_s" in x
    ]


def test_ddp_noise_scale_and_world_mfu(corpus_dir, tmp_path):
    over = _over(corpus_dir, tmp_path, **{"parallel.dp_replicate": 2})
    launch(2, tmp_path / "run", over)
    cfg = load_config(None, over)
    fpt = model_flops_per_token(cfg.model, 512, cfg.data.seq_len)  # the tiny tokenizer fills its 512
    for r in _records(tmp_path / "run"):
        _check_noise_scale(r)
        assert r["batch_tokens"] == 512
        # float64: the logged mfu is this formula over 2 ranks in another order (~1e-16); rel 1e-9 is room
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (2 * r["peak_tflops"] * 1e12), rel=1e-9)


def test_fsdp_skips_the_noise_scale_with_a_reason(corpus_dir, tmp_path):
    done = launch(2, tmp_path / "run", _over(corpus_dir, tmp_path, **{"parallel.dp_shard": 2}))
    assert "gradient noise scale: not measured: FSDP2" in done.stderr
    assert all("gns_critical_batch" not in r for r in _records(tmp_path / "run"))
