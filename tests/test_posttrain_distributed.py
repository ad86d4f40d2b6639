"""SFT under DDP and DPO under FSDP2 (two processes, gloo) train as one process does: a run folder started
in one process (``--prepare-only``), then resumed under torchrun."""

from __future__ import annotations

import json

import pytest

from lmforge.posttrain.finetune import start
from lmforge.train.launch import train
from tests.test_posttrain_runs import (  # noqa: F401 (fixture)
    HELD_OUT_FUNCS,
    _held_out,
    _pairs,
    _sft_overrides,
    pretrained,
)
from tests.torchrun import torchrun


def _losses(run) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kind,layout", [("sft", {"parallel.dp_replicate": 2}), ("dpo", {"parallel.dp_shard": 2})]
)
def test_layout_trains_like_one_process(kind, layout, pretrained, tmp_path):  # noqa: F811
    over = _sft_overrides(tmp_path, steps=6, **{"train.micro_batch_size": 2, "train.tokens_per_step": 4 * 64})
    if kind == "dpo":
        over["posttrain.train_files"] = [str(_pairs(tmp_path / "p.jsonl", 16))]
        held = _pairs(tmp_path / "pv.jsonl", 4, HELD_OUT_FUNCS)  # questions training never saw
        over["posttrain.val_files"] = [str(_held_out(tmp_path / "p.jsonl", held))]
        over["optim.lr"] = 1e-3
    one = tmp_path / "one"
    cfg, _ = start(kind, pretrained, one, overrides=over)
    single = train(cfg, one, resume=True, progress_bar=False)
    two = tmp_path / "two"
    start(kind, pretrained, two, overrides={**over, **layout})
    done = torchrun(2, ["-m", "lmforge", kind, "--resume", "--run-dir", str(two)])
    assert done.returncode == 0, done.stderr[-4000:]
    got, want = _losses(two), _losses(one)
    # FP32 runs (post-training starts from an FP32 checkpoint): two ranks sum the gradients in another
    # order, ~1e-7 relative a step (u = 2^-24 times sums of a few hundred terms, random walk), which six
    # Adam steps at lr 1e-3 magnify; 1e-4 is that room, not a figure measured here. Not yet moved to
    # float64 (train.precision = fp64) as the pretraining layout tests were: see the report of issue 33
    assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], rel=1e-4) for s in want)
    summary = json.loads((two / "summary.json").read_text())
    # the same FP32 room as the losses above, for the final model's validation loss (not measured here)
    assert summary["val_loss"] == pytest.approx(single["val_loss"], rel=1e-4)
    if kind == "dpo":  # TRL-named figures, over both ranks' pairs
        lines = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
        assert "rewards/margins" in [x for x in lines if "loss" in x][-1]
