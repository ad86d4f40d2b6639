"""The batch-size schedule (``train.batch_schedule``, ``optim/batch_schedule.py``): the rules against hand
computations, a ramp and a noise-driven run step by step (micro-batches per step, the loader's sequences,
the tokens seen, the learning rate), resumes equal to uninterrupted runs, and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.data.loader import PackedLoader, TokenStream
from lmforge.errors import ConfigError
from lmforge.optim.batch_schedule import check_batch_schedule, lr_factor, noise_accum, ramp_accum
from lmforge.optim.schedules import Schedule
from lmforge.recipe import load_config
from lmforge.train.build import accumulation_steps
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import cli_args, tiny_overrides

MICRO = 4 * 32  # tokens of a micro-step in tiny_overrides: 4 sequences of 32 tokens, one process


class Recorder(Callback):
    """Per step: the micro-batches taken, their inputs, the learning rate and the tokens seen after it."""

    def __init__(self) -> None:
        self.accum: list[int] = []
        self.inputs: list[torch.Tensor] = []
        self.lr: list[float] = []
        self.tokens: list[int] = []
        self.data = None

    def on_train_start(self, trainer) -> None:
        self.data = trainer.run.data

    def on_batches(self, trainer, batches):
        self.accum.append(len(batches))
        self.inputs += [b.inputs for b in batches]
        return batches

    def on_step_end(self, trainer, result) -> None:
        self.lr.append(trainer.lr)
        self.tokens.append(trainer.progress.tokens_seen)


def test_rules_equal_hand_computations():
    # ramp from 1 to 4 micro-batches over 1536 tokens: a = min(4, 1 + 3 T // 1536)
    assert [ramp_accum(t, 1, 4, 1536) for t in (0, 511, 512, 1023, 1024, 1535, 1536, 10**6)] == [
        1, 1, 2, 2, 3, 3, 4, 4,
    ]  # fmt: skip
    # noise: k B_simple / m = 2 * 700 / 128 = 10.9 -> 10; kept at the current 3 below it; capped at 8
    assert noise_accum(700.0, 128, 3, 16, 2.0) == 10
    assert noise_accum(100.0, 128, 3, 16, 2.0) == 3
    assert noise_accum(5000.0, 128, 3, 8, 1.0) == 8
    assert noise_accum(float("nan"), 128, 3, 8, 1.0) == 3 and noise_accum(-4.0, 128, 3, 8, 1.0) == 3
    # learning rate at 1 of 4 micro-batches: x 1/4 (linear), x 1/2 (sqrt), x 1 (none)
    assert (lr_factor(1, 4, "linear"), lr_factor(1, 4, "sqrt"), lr_factor(1, 4, "none")) == (0.25, 0.5, 1.0)


def _ramp_over(corpus_dir: Path, cache: Path) -> dict:
    return tiny_overrides(corpus_dir, cache) | {
        "train.steps": 12,
        "train.tokens_per_step": 4 * MICRO,
        "train.batch_schedule.name": "ramp",
        "train.batch_schedule.start_tokens_per_step": MICRO,
        "train.batch_schedule.ramp_tokens": 12 * MICRO,
        "train.eval_interval": 0,
        "train.sample_tokens": 0,
        "train.checkpoint_interval": 0,
        "train.log_interval": 1,
    }


def test_a_ramp_takes_the_planned_micro_batches_reads_the_stream_in_order_and_scales_the_rate(
    corpus_dir, tmp_path
):
    """1 to 4 micro-batches of 128 tokens over 1536 tokens: by hand, steps 1-4 take 1 (T < 512), steps 5-6
    take 2 (T = 512, 768), steps 7-8 take 3 (T = 1024, 1408), then 4. The micro-batches are the loader's
    sequences in order, as a fresh loader yields them; the rate is the schedule's times sqrt(a / 4)."""
    cfg = load_config(None, _ramp_over(corpus_dir, tmp_path / "data"))
    rec = Recorder()
    summary = train(cfg, tmp_path / "run", progress_bar=False, callbacks=[rec])
    assert rec.accum == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    assert rec.tokens == list(np.cumsum(rec.accum) * MICRO) and summary["tokens_seen"] == 30 * MICRO
    fresh = PackedLoader(TokenStream(rec.data.train), 32, 4, cfg.train.seed)
    for got in rec.inputs:
        assert torch.equal(got, fresh.next_batch().inputs)
    state = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert state["loader"]["position"] == 30 * 4  # sequences: 30 micro-batches of 4
    schedule = Schedule(cfg.schedule, cfg.train.steps)
    want = [3e-3 * schedule(s) * math.sqrt(a / 4) for s, a in enumerate(rec.accum)]
    assert rec.lr == pytest.approx(want, rel=1e-12)  # float64 products: rounding only
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch_tokens"] for r in logged if "batch_tokens" in r] == [a * MICRO for a in rec.accum]


def _same_end(a: Path, b: Path) -> None:
    sa, sb = (load_checkpoint(latest_checkpoint(r)) for r in (a, b))
    for key, value in sa["model"].items():
        assert torch.equal(value, sb["model"][key]), key
    assert sa["loader"] == sb["loader"] and sa["progress"]["tokens_seen"] == sb["progress"]["tokens_seen"]
    assert sa["batch_schedule"] == sb["batch_schedule"]


def test_a_ramp_resumed_mid_way_equals_the_uninterrupted_run(corpus_dir, tmp_path):
    """Stopped after step 5 (inside the ramp), resumed: weights bitwise, loader and tokens equal."""
    cfg = load_config(None, _ramp_over(corpus_dir, tmp_path / "data"))
    train(cfg, tmp_path / "a", progress_bar=False)
    train(cfg, tmp_path / "b", progress_bar=False, callbacks=[StopAfter(5)])
    rec = Recorder()
    train(cfg, tmp_path / "b", resume=True, progress_bar=False, callbacks=[rec])
    assert rec.accum == [2, 3, 3, 4, 4, 4, 4]
    _same_end(tmp_path / "a", tmp_path / "b")


def test_the_noise_rule_follows_the_measured_noise_scale_and_resumes_exactly(corpus_dir, tmp_path):
    """From 2 to at most 16 micro-batches, a decision every 3 steps at 4 x B_simple: after each decision
    step the batch is min(16, max(a, floor(4 B / 128))), with B the critical batch that the step metrics
    log at that step (their own moving averages of the same measurements); it never shrinks, grows at
    least once, and a run stopped between decisions and resumed ends as the uninterrupted one."""
    over = _ramp_over(corpus_dir, tmp_path / "data") | {
        "train.steps": 9,
        "train.tokens_per_step": 16 * MICRO,
        "train.batch_schedule.name": "noise",
        "train.batch_schedule.start_tokens_per_step": 2 * MICRO,
        "train.batch_schedule.interval": 3,
        "train.batch_schedule.noise_multiple": 4.0,
        "train.log_interval": 3,
    }
    cfg = load_config(None, over)
    rec = Recorder()
    train(cfg, tmp_path / "a", progress_bar=False, callbacks=[rec])
    logged = {
        r["step"]: r["gns_critical_batch"]
        for r in map(json.loads, (tmp_path / "a" / "metrics.jsonl").read_text().splitlines())
        if "gns_critical_batch" in r
    }
    want, a = [2, 2, 2], 2
    for step in (3, 6):
        a = min(16, max(a, math.floor(4 * logged[step] / MICRO)))
        want += [a] * 3
    assert rec.accum == want and want[-1] > 2, (want, logged)
    train(cfg, tmp_path / "b", progress_bar=False, callbacks=[StopAfter(4)])
    train(cfg, tmp_path / "b", resume=True, progress_bar=False)
    _same_end(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize(
    "over, words",
    [
        ({"train.batch_schedule.start_tokens_per_step": 100}, "not a multiple"),
        ({"train.batch_schedule.start_tokens_per_step": 4 * MICRO}, "below train.tokens_per_step"),
        ({"train.batch_schedule.name": "noise"}, "two micro-batches"),
        ({"train.batch_schedule.ramp_tokens": 0}, "ramp_tokens"),
        ({"data.phases": [{"until_step": 5}, {}]}, "data.phases"),
    ],
)
def test_bad_schedules_are_refused_in_one_line_before_any_work(corpus_dir, tmp_path, capsys, over, words):
    cfg = _ramp_over(corpus_dir, tmp_path / "data") | over
    with pytest.raises(SystemExit) as done:
        main(["train", "--run-dir", str(tmp_path / "run"), *cli_args(cfg)])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and words in err and "\n" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_objectives_and_layouts_whose_step_is_not_micro_batches_of_sequences_are_refused():
    base = {"train.tokens_per_step": 4 * 8 * 1024, "train.batch_schedule.name": "ramp"}
    base |= {
        "train.batch_schedule.start_tokens_per_step": 8 * 1024,
        "train.batch_schedule.ramp_tokens": 10**5,
    }
    for over, words in (
        ({"parallel.pp": 2}, "pipeline"),
        ({"train.objective": "dpo"}, "lm and sft runs only"),
        ({"parallel.dp_shard": 2, "train.batch_schedule.name": "noise"}, "fsdp splits"),
    ):
        cfg = load_config(None, base | over)
        with pytest.raises(ConfigError, match=words):
            check_batch_schedule(cfg, accumulation_steps(cfg, cfg.parallel.dp_shard))
