"""Clipping modes against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.errors import ConfigError
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.recipe import load_config
from tests.conftest import model_of


def _params(*grads: list[float]) -> list[torch.Tensor]:
    out = []
    for g in grads:
        p = torch.zeros(len(g), requires_grad=True)
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def _clip(clipper: Clipper, groups: list[list[torch.Tensor]]):
    norm = clipper.measure(groups)
    return norm, clipper.clip(groups, norm)


# Tolerances: FP32 norms and ratios against hand values. pytest.approx's default (1e-6 relative) is 8 FP32
# ulps (2^-23 = 1.2e-7); the ratios also carry the 1e-6 the clip adds to the norm (2e-7 relative at norm 5).
# Measured at most 21% of the default (the ratio 0.2, 2.1e-7); the rel=1e-5 / 1e-4 ones compare sums of
# several FP32 norms (measured <= 1.4e-7 relative).


def test_norm_mode():
    a, b = _params([3.0, 0.0], [0.0, 4.0])  # global norm 5
    norm, stats = _clip(Clipper("norm", max_norm=1.0), [[a], [b]])
    # FP32 against hand values (see the note above): approx's default 1e-6 and assert_close's FP32 default
    assert norm.item() == pytest.approx(5.0)
    scale = 1.0 / (5.0 + 1e-6)
    torch.testing.assert_close(a.grad, torch.tensor([3.0 * scale, 0.0]))
    torch.testing.assert_close(b.grad, torch.tensor([0.0, 4.0 * scale]))
    assert stats.ratio.item() == pytest.approx(0.2) and stats.threshold == 1.0
    c, d = _params([0.3], [0.4])  # norm 0.5 < 1: untouched, ratio exactly 1
    norm, stats = _clip(Clipper("norm", max_norm=1.0), [[c], [d]])
    # default approx: 0.3 untouched, FP32's 0.3 is 4e-8 relative from the decimal
    assert c.grad.item() == pytest.approx(0.3) and stats.ratio.item() == 1.0
    e, f = _params([3.0], [4.0])
    _, stats = _clip(Clipper("norm", max_norm=0.0), [[e, f]])  # 0: off
    assert e.grad.item() == 3.0 and stats.ratio.item() == 1.0 and stats.threshold is None


def test_value_mode():
    (a,) = _params([0.5, -2.0, 3.0])
    norm, stats = _clip(Clipper("value", value=1.0), [[a]])
    # FP32 norm of 3 values and an FP32 ratio against float64 hand values: a few ulps (1.2e-7) under 1e-6
    assert norm.item() == pytest.approx(math.sqrt(0.25 + 4 + 9))
    assert a.grad.tolist() == [0.5, -1.0, 1.0]
    assert stats.ratio.item() == pytest.approx(math.sqrt(0.25 + 1 + 1) / math.sqrt(13.25))
    assert stats.threshold is None
    (b,) = _params([0.5, -0.25])
    _, stats = _clip(Clipper("value", value=1.0), [[b]])
    assert b.grad.tolist() == [0.5, -0.25] and stats.ratio.item() == 1.0


def test_group_norm_mode():
    a, b, c = _params([3.0], [4.0], [0.3, 0.4])  # group norms 5 and 0.5
    norm, stats = _clip(Clipper("group_norm", max_norm=1.0), [[a, b], [c]])
    # FP32 against hand values as in test_norm_mode; rel=1e-5 for a ratio of FP32 group norms (note above)
    assert norm.item() == pytest.approx(math.sqrt(25.25))
    scale = 1.0 / (5.0 + 1e-6)
    assert a.grad.item() == pytest.approx(3.0 * scale) and b.grad.item() == pytest.approx(4.0 * scale)
    assert c.grad.tolist() == pytest.approx([0.3, 0.4])  # below its threshold: untouched
    assert stats.ratio.item() == pytest.approx(math.sqrt(1.0 + 0.25) / math.sqrt(25.25), rel=1e-5)


def test_group_norm_on_real_optimizer_groups():
    torch.manual_seed(0)
    m = model_of(ModelConfig(n_layers=1, d_model=32, n_heads=4), 50, 8)
    opt = build_optimizer(m, OptimConfig(), torch.device("cpu"))
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    groups = [g["params"] for g in opt.param_groups]
    assert len(groups) >= 2
    _clip(Clipper("group_norm", max_norm=0.5), groups)
    for params in groups:
        n = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        assert n.item() == pytest.approx(0.5, rel=1e-4)  # each group was far above 0.5


def test_adaptive_mode_and_its_state():
    clipper = Clipper("adaptive", max_norm=0.0, factor=2.0, beta=0.5, warmup=2)
    got = []
    for n in [1.0, 3.0, 10.0, 1.0]:
        (p,) = _params([n])
        thr = clipper.threshold()
        _, stats = _clip(clipper, [[p]])
        got.append((None if thr is None else float(thr), p.grad.item(), stats.ratio.item()))
    # m1 = 0.5 * 1 = 0.5; m2 = 0.25 + 1.5 = 1.75 (warmup: threshold grad_clip = 0, none);
    # c2 = 2 * 1.75 / (1 - 0.25) = 4.6667: 10 -> 4.6667, m3 = 0.875 + 2.3333 = 3.2083;
    # c3 = 2 * 3.2083 / (1 - 0.125) = 7.3333: 1 untouched.
    c2, c3 = 2 * 1.75 / 0.75, 2 * 3.2083333 / 0.875
    assert got[0] == (None, 1.0, 1.0) and got[1] == (None, 3.0, 1.0)
    # rel=1e-5: FP32 EMA thresholds after 3 steps (a few ulps, ~1e-7 relative) against hand values,
    # c3 from the 8-digit 3.2083333 (1e-8 relative); the clip's +1e-6 on the norm 10 is 1e-7 relative
    assert got[2] == pytest.approx((c2, c2, c2 / 10), rel=1e-5)
    assert got[3] == pytest.approx((c3, 1.0, 1.0), rel=1e-5)
    other = Clipper("adaptive", max_norm=0.0, factor=2.0, beta=0.5, warmup=2)
    other.load_state_dict(clipper.state_dict())
    assert float(other.threshold()) == float(clipper.threshold()) and other.count == 4
    fallback = Clipper("adaptive", max_norm=1.0, warmup=3)
    assert fallback.threshold() == 1.0  # before warmup ends: train.grad_clip


def test_adaptive_ignores_a_nonfinite_norm():
    clipper = Clipper("adaptive", max_norm=0.0, beta=0.5, warmup=1)
    _clip(clipper, [_params([2.0])])
    _clip(clipper, [_params([float("nan")])])
    assert math.isfinite(float(clipper.threshold()))


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            {"train.clip_mode": "value"},
            "train.value_clip.limit: clip_mode 'value' needs train.value_clip.limit above 0",
        ),
        ({"train.clip_mode": "elementwise"}, "train.clip_mode:"),
        ({"train.adaptive_clip.warmup": 0}, "train.adaptive_clip.warmup:"),
        ({"train.adaptive_clip.beta": 1.0}, "train.adaptive_clip.beta:"),
        ({"guard.spike_min_history": 200}, "guard.spike_min_history: 200 exceeds guard.spike_window (100)"),
        ({"guard.max_bad_steps": 0}, "guard.max_bad_steps:"),
        ({"guard.rollback_lr_factor": 1.5}, "guard.rollback_lr_factor:"),
    ],
)
def test_bad_clip_and_guard_keys_are_named(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert needle in str(info.value)
