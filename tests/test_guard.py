"""The stability guard: unit checks, and real runs disturbed through a callback (NaN gradients,
batches whose targets are a token the training data never contains) that must recover."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch

from lmforge.config import GuardConfig, ModelConfig, OptimConfig
from lmforge.data.loader import Batch, PackedLoader, TokenStream
from lmforge.data.prepare import prepare_data
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.callbacks.guard import Action, Guard, GuardObserver, TrainingDiverged, spike_limit
from lmforge.train.checkpoint import load_checkpoint
from lmforge.train.launch import train
from lmforge.train.modules import LanguageModelModule
from lmforge.train.step import train_step
from tests.conftest import model_of, same_value, suite_threads, tiny_overrides

CPU = torch.device("cpu")

# 30 steps at a higher learning rate than the other tiny runs, so the model has left the uniform
# distribution by step ~12 and a poisoned batch gives a loss far above the recent ones.
GUARD_RUN = {
    "train.steps": 30,
    "optim.lr": 1e-2,
    "train.log_interval": 1,
    "train.eval_interval": 0,
    "train.checkpoint_interval": 10,
    "train.keep_checkpoints": 3,
    "train.sample_tokens": 0,
    "guard.spike_window": 20,
    "guard.spike_min_history": 5,
}

# Tolerances: spike limits and loss windows are float64 arithmetic on Python numbers, compared with
# pytest.approx's default (1e-6 relative) for rounding only; the bounds on whole runs (clip ratios, validation
# losses) say where they come from where they are asserted.


# ---------------------------------------------------------------------------------------------------------
# units


def test_spike_limit_formula():
    # mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    # default approx: a float64 formula against the hand value (the note above)
    assert spike_limit([1.0, 2.0, 3.0, 4.0], 2.0) == pytest.approx(2.5 + 2 * math.sqrt(1.25))


def test_guard_verdicts_and_state():
    events = []
    guard = Guard(
        GuardConfig(spike_sigmas=3.0, spike_window=4, spike_min_history=3, max_bad_steps=2), events.append
    )
    t = torch.tensor
    for i, loss in enumerate([5.0, 5.2, 4.8]):
        assert guard.spike_limit() is None  # fewer than spike_min_history losses
        assert guard.check(i + 1, t(loss), t(1.0)) is Action.STEP
    limit = spike_limit([5.0, 5.2, 4.8], 3.0)
    # default approx: the guard holds FP32 losses (5.2 -> 5.1999998, 4e-8 relative), the formula decimals
    assert guard.spike_limit() == pytest.approx(limit)
    assert guard.check(4, t(limit + 0.01), t(1.0)) is Action.SKIP
    assert guard.check(4, t(5.0), t(float("inf"))) is Action.ROLLBACK  # second bad step in a row
    assert [(e["step"], e["event"], e["consecutive"]) for e in events] == [
        (4, "skip_spike", 1),
        (4, "skip_nonfinite", 2),
    ]
    assert guard.check(4, t(5.1), t(1.0)) is Action.STEP and guard.bad == 0
    guard.check(5, t(5.0), t(1.0))
    # default approx: floats of FP32 tensors against decimals (<= 4e-8 relative)
    assert guard.losses == pytest.approx([5.2, 4.8, 5.1, 5.0])  # the window keeps the newest 4
    other = Guard(guard.cfg)
    other.load_state_dict(guard.state_dict())
    assert other.state_dict() == guard.state_dict()
    off = Guard(GuardConfig(enabled=False))
    assert off.check(1, t(float("nan")), t(1.0)) is Action.STEP


def test_nonfinite_loss_is_skipped():
    events = []
    guard = Guard(GuardConfig(max_bad_steps=3), events.append)
    t = torch.tensor
    assert guard.check(1, t(float("nan")), t(1.0)) is Action.SKIP
    assert guard.check(1, t(float("-inf")), t(1.0)) is Action.SKIP
    assert [e["event"] for e in events] == ["skip_nonfinite"] * 2 and guard.losses == []


def test_rl_runs_take_the_steps_spike_detection_would_skip():
    # An RL step's loss is the advantage-weighted surrogate plus beta x KL: a high one is a batch whose
    # completions differ much in reward, or a KL that grows, not a broken step. Measured: with spike
    # detection on, RL runs of benchmarks/rl_addition.py skipped up to 11 of 400 steps and one rolled back
    # to step 0 at step 31. lmforge rl turns spike detection off and still skips non-finite steps.
    from lmforge.config import POSTTRAIN_DEFAULTS

    rl = Guard(load_config(None, {}, defaults=POSTTRAIN_DEFAULTS["rl"]).guard)
    lm = Guard(load_config(None, {}).guard)
    t = torch.tensor
    losses = [0.001 * (1 + 0.1 * (i % 3)) for i in range(lm.cfg.spike_min_history)]
    for i, loss in enumerate(losses):
        assert (
            rl.check(i + 1, t(loss), t(1.0)) is Action.STEP
            and lm.check(i + 1, t(loss), t(1.0)) is Action.STEP
        )
    high = 10 * max(losses)  # far above mean + 6 sd of the window
    assert lm.check(len(losses) + 1, t(high), t(1.0)) is Action.SKIP  # a language model's spike
    assert rl.check(len(losses) + 1, t(high), t(1.0)) is Action.STEP
    assert rl.check(len(losses) + 2, t(float("nan")), t(1.0)) is Action.SKIP


class GuardAt(GuardObserver):
    """The guard's step observer, also running ``on_grads`` after the backward pass."""

    def __init__(self, guard: Guard, step: int, on_grads=None):
        super().__init__(guard, step)
        self.on_grads = on_grads

    def after_backward(self) -> None:
        if self.on_grads is not None:
            self.on_grads()


class Disturb(Callback):
    """Disturbs a real run: ``batches(attempt, micro_batches)`` may return changed micro-batches,
    ``grads(attempt, model)`` may change the gradients after the backward pass. ``attempt`` counts step
    attempts from 0 in this process, skipped and rolled-back ones included."""

    def __init__(self, batches=None, grads=None):
        self.batches, self.grads = batches, grads

    def on_batches(self, trainer, batches):
        return self.batches(trainer.attempt, batches) if self.batches is not None else batches

    def after_backward(self, trainer) -> None:
        if self.grads is not None:
            self.grads(trainer.attempt, trainer.run.model)


def test_skipped_step_leaves_optimizer_untouched():
    torch.manual_seed(0)
    m = model_of(ModelConfig(n_layers=1, d_model=32, n_heads=4), 50, 8)
    opt = build_optimizer(m, OptimConfig(), CPU)
    guard = Guard(GuardConfig())
    x = torch.randint(0, 50, (2, 8))
    batch = [Batch(x, x, torch.zeros_like(x))]
    fp32, clipper = PrecisionPolicy("fp32", CPU), Clipper("norm", 1.0)
    objective = LanguageModelModule.of(NextTokenLoss(m))
    for step in (1, 2):
        out = train_step(objective, opt, batch, 1e-3, clipper, fp32, [GuardAt(guard, step)])
        assert out.action is Action.STEP
    opt_before = copy.deepcopy(opt.state_dict())
    params_before = {n: p.detach().clone() for n, p in m.named_parameters()}

    def poison():
        m.blocks[0].mlp.up_proj.weight.grad[0, 0] = float("nan")

    out = train_step(objective, opt, batch, 1e-3, clipper, fp32, [GuardAt(guard, 3, poison)])
    assert out.action is Action.SKIP and out.clip is None and not math.isfinite(out.grad_norm.item())
    after = opt.state_dict()
    assert after["param_groups"] == opt_before["param_groups"]
    for k, state in opt_before["state"].items():
        for name, value in state.items():  # exp_avg, exp_avg_sq and the step count
            assert torch.equal(after["state"][k][name], value), (k, name)
    for n, p in m.named_parameters():
        assert torch.equal(p, params_before[n]) and p.grad is None, n


# ---------------------------------------------------------------------------------------------------------
# real runs


def _lines(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _events(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "event" in x]


def _train_lines(lines: list[dict]) -> list[dict]:
    return [x for x in lines if "loss" in x and "event" not in x]


def nan_grads(attempts: set[int]):
    def hook(attempt: int, model: Transformer) -> None:
        if attempt in attempts:
            model.blocks[0].attn.q_proj.weight.grad[0, 0] = float("nan")

    return hook


def rare_targets(cfg, attempts: set[int]):
    """Targets replaced by a token that never occurs in the training data: a hugely higher loss."""
    rare = int(prepare_data(cfg.data).unigram_counts.argmin())

    def hook(attempt: int, batches: list[Batch]) -> list[Batch]:
        if attempt in attempts:
            for b in batches:
                b.targets[b.targets != -100] = rare
        return batches

    return hook


@pytest.fixture(scope="module")
def guard_overrides(corpus_dir, tmp_path_factory) -> dict:
    return {**tiny_overrides(corpus_dir, tmp_path_factory.mktemp("data")), **GUARD_RUN}


@pytest.fixture(scope="module")
def undisturbed(guard_overrides, tmp_path_factory):
    torch.set_num_threads(suite_threads())  # what the autouse fixture gives the tests that compare with it
    run = tmp_path_factory.mktemp("undisturbed")
    summary = train(load_config(None, guard_overrides), run, progress_bar=False)
    return summary, _lines(run)


def test_pre_clip_norm_and_clip_events_in_metrics(undisturbed):
    """grad_norm is the norm before clipping: clip_ratio = min(1, grad_clip / grad_norm), and
    clipped_steps counts the steps of the logging window (here 1 step) that were clipped."""
    _, lines = undisturbed
    steps = _train_lines(lines)
    ratios = [x["clip_ratio"] for x in steps]
    assert min(ratios) < 1 and max(ratios) == 1  # the run has clipped and unclipped steps
    for x in steps:
        assert x["clip_threshold"] == 1.0
        # the logged FP32 ratio against the formula on the logged norm: one FP32 rounding (measured 5.6e-8)
        assert x["clip_ratio"] == pytest.approx(min(1.0, 1.0 / (x["grad_norm"] + 1e-6)), rel=1e-5)
        assert x["clipped_steps"] == int(x["clip_ratio"] < 1)


def test_without_the_guard_nan_gradients_ruin_the_run(guard_overrides, tmp_path):
    """The disturbance of the tests below is real: unguarded, one NaN gradient ends the run in NaN."""
    cfg = load_config(None, {**guard_overrides, "guard.enabled": False, "train.steps": 10})
    summary = train(cfg, tmp_path / "run", progress_bar=False, callbacks=[Disturb(grads=nan_grads({7}))])
    assert math.isnan(summary["val_loss"]) and summary["skipped_steps"] == 0
    assert not _events(_lines(tmp_path / "run"))


def test_nan_gradients_are_skipped(guard_overrides, undisturbed, tmp_path, caplog):
    base, base_lines = undisturbed
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="lmforge.train.callbacks.guard"):
        summary = train(
            load_config(None, guard_overrides),
            run,
            progress_bar=False,
            callbacks=[Disturb(grads=nan_grads({7, 15}))],
        )
    lines = _lines(run)
    events = _events(lines)
    assert [(e["step"], e["event"]) for e in events] == [(8, "skip_nonfinite"), (15, "skip_nonfinite")]
    assert events[0]["grad_norm"] is None and math.isfinite(events[0]["loss"])  # NaN is written as null
    assert "step 8: skip_nonfinite" in caplog.text
    steps, base_steps = _train_lines(lines), _train_lines(base_lines)
    assert [x["step"] for x in steps] == list(range(1, 31))
    assert [x["loss"] for x in steps[:7]] == [x["loss"] for x in base_steps[:7]]
    assert [x["lr"] for x in steps] == [x["lr"] for x in base_steps]  # skips do not advance the schedule
    assert summary["skipped_steps"] == 2 and summary["rollbacks"] == 0
    assert summary["tokens_seen"] == base["tokens_seen"]
    # not rounding: two of 30 steps skipped move the final loss (measured 0.60%); the three runs of this file
    # measured 0.16% to 0.60%, and 2% is 3x the largest
    assert summary["val_loss"] == pytest.approx(base["val_loss"], rel=0.02)


def test_loss_spike_is_skipped(guard_overrides, undisturbed, tmp_path):
    base, base_lines = undisturbed
    cfg = load_config(None, guard_overrides)
    summary = train(
        cfg, tmp_path / "run", progress_bar=False, callbacks=[Disturb(batches=rare_targets(cfg, {20}))]
    )
    lines = _lines(tmp_path / "run")
    (event,) = _events(lines)
    assert event["step"] == 21 and event["event"] == "skip_spike"
    before = _train_lines(base_lines)[19]["loss"]  # step 20, identical in both runs
    assert event["loss"] > event["limit"] and event["loss"] > before + 2.0  # a huge spike, skipped
    assert [x["step"] for x in _train_lines(lines)] == list(range(1, 31))
    assert summary["skipped_steps"] == 1 and summary["rollbacks"] == 0
    # not rounding: one skipped step moves the final loss (0.16% measured, below); 2% as in the test above
    assert summary["val_loss"] == pytest.approx(
        base["val_loss"], rel=0.02
    )  # one step skipped: 0.16% measured


def _rollback_hooks(cfg, seen: dict) -> Disturb:
    """Attempt 13 gets NaN gradients, 14 and 15 poisoned batches: three bad steps in a row at step 14.
    Records the parameters and the batch of attempt 16, the first after the rollback."""
    poison = rare_targets(cfg, {14, 15})

    def batches(attempt: int, got: list[Batch]) -> list[Batch]:
        if attempt == 16:
            seen["batch"] = got[0]
        return poison(attempt, got)

    def grads(attempt: int, model: Transformer) -> None:
        nan_grads({13})(attempt, model)
        if attempt == 16:  # gradients computed, parameters not yet stepped
            seen["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    return Disturb(batches=batches, grads=grads)


def test_consecutive_bad_steps_roll_back(guard_overrides, undisturbed, tmp_path):
    base, base_lines = undisturbed
    cfg = load_config(None, {**guard_overrides, "guard.rollback_lr_factor": 0.5})
    run, seen = tmp_path / "run", {}
    summary = train(cfg, run, progress_bar=False, callbacks=[_rollback_hooks(cfg, seen)])
    lines = _lines(run)
    events = _events(lines)
    assert [(e["step"], e["event"]) for e in events] == [
        (14, "skip_nonfinite"),
        (14, "skip_spike"),
        (14, "skip_spike"),
        (14, "rollback"),
        (14, "lr_change"),
        (14, "data_skip"),
    ]
    rollback, lr_change, data_skip = events[3:]
    assert rollback["to_step"] == 10 and rollback["rollbacks"] == 1
    assert lr_change["lr_scale"] == 0.5 and lr_change["previous_lr_scale"] == 1.0
    # 4 sequences per step: the snapshot was at sequence 40, 16 attempts have read up to 64
    assert (data_skip["from_sequence"], data_skip["to_sequence"], data_skip["sequences"]) == (40, 64, 24)

    # the model came back to the step-10 checkpoint, and the loader went on at sequence 64
    at_10 = load_checkpoint(run / "checkpoints" / "step_00000010")
    for key, value in at_10["model"].items():
        assert torch.equal(seen["params"][key], value), key
    data = prepare_data(cfg.data)
    fresh = PackedLoader(
        TokenStream(data.train), cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed
    )
    fresh.position = 64
    assert torch.equal(seen["batch"].inputs, fresh.next_batch().inputs)

    steps, base_steps = _train_lines(lines), _train_lines(base_lines)
    assert [x["step"] for x in steps] == list(range(1, 14)) + list(range(11, 31))
    assert [x["lr"] for x in steps[13:]] == [0.5 * x["lr"] for x in base_steps[10:]]
    assert summary["skipped_steps"] == 3 and summary["rollbacks"] == 1
    assert summary["tokens_seen"] == base["tokens_seen"]
    assert summary["val_loss"] == pytest.approx(base["val_loss"], rel=0.02)  # a rollback: 0.32% measured


def test_rollback_run_resumes_exactly_with_adaptive_clipping(guard_overrides, tmp_path):
    over = {**guard_overrides, "train.clip_mode": "adaptive", "train.adaptive_clip.warmup": 5}
    cfg = load_config(None, {**over, "guard.rollback_lr_factor": 0.5})
    straight = train(cfg, tmp_path / "straight", progress_bar=False, callbacks=[_rollback_hooks(cfg, {})])
    train(cfg, tmp_path / "resumed", progress_bar=False, callbacks=[_rollback_hooks(cfg, {}), StopAfter(20)])
    resumed = train(cfg, tmp_path / "resumed", resume=True, progress_bar=False)
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_00000030")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "step_00000030")
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for k, value in a["optimizer"].items():
        assert same_value(value, b["optimizer"][k]), k
    assert a["guard"] == b["guard"] and a["guard"]["lr_scale"] == 0.5 and a["guard"]["rollbacks"] == 1
    assert torch.equal(a["clip"]["ema"], b["clip"]["ema"]) and a["clip"]["count"] == b["clip"]["count"] == 30
    assert resumed["val_loss"] == straight["val_loss"]
    key = [(x["step"], x.get("event")) for x in _lines(tmp_path / "straight")]
    assert [(x["step"], x.get("event")) for x in _lines(tmp_path / "resumed")] == key
    thresholds = [x["clip_threshold"] for x in _train_lines(_lines(tmp_path / "straight"))]
    assert thresholds[0] == 1.0 and len(set(thresholds[5:])) > 5  # grad_clip in warmup, then adaptive


def test_too_many_rollbacks_stop_the_run(guard_overrides, tmp_path):
    cfg = load_config(None, {**guard_overrides, "guard.max_bad_steps": 2, "guard.max_rollbacks": 0})
    with pytest.raises(TrainingDiverged, match=r"guard\.max_rollbacks: 2 bad steps in a row at step 4"):
        train(cfg, tmp_path / "run", progress_bar=False, callbacks=[Disturb(grads=nan_grads({3, 4}))])
