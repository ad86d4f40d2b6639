"""Each schedule against its formula at hand-computed points (formulas: lmforge/optim/schedules.py)."""

from __future__ import annotations

import math

import pytest

from lmforge.config import ScheduleConfig
from lmforge.errors import ConfigError
from lmforge.optim.schedules import SCHEDULE_NAMES, Schedule, lr_multiplier, warmup_steps
from lmforge.recipe import load_config

# Tolerances: every pytest.approx here keeps its default (1e-6 relative, 1e-12 absolute). The schedules are
# float64 formulas on Python numbers, the same on every CPU: the default only absorbs the rounding of one
# formula written in another order (~1e-16 relative).


def S(name: str, **kw) -> ScheduleConfig:
    return ScheduleConfig(name=name, **kw)


def test_warmup_in_steps_or_fraction():
    assert warmup_steps(100, 1000) == 100 and warmup_steps(0.05, 1000) == 50 and warmup_steps(0, 10) == 0
    for name in SCHEDULE_NAMES:
        if name in ("one_cycle",):
            continue
        cfg = S(name, warmup=0.1, min_lr_ratio=0.1)
        # default approx: float64 formulas (see the note at the top)
        assert Schedule(cfg, 200)(0) == pytest.approx(1 / 20), name
        assert Schedule(cfg, 200)(19) == pytest.approx(1.0), name
    with pytest.raises(ConfigError, match=r"schedule\.warmup"):
        load_config(None, {"schedule.warmup": 10.5})


@pytest.mark.parametrize(
    ("name", "kw", "step", "want"),
    [
        ("constant", {}, 500, 1.0),
        ("linear", {}, 60, 1 - 0.9 * 0.5),  # W=10, T=110: p = 50/100
        ("cosine", {}, 60, 0.1 + 0.9 * 0.5),
        ("cosine", {}, 35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", {}, 110, 0.1),
        ("polynomial", {"polynomial": {"power": 2.0}}, 60, 0.1 + 0.9 * 0.25),
        ("exponential", {}, 60, 0.1**0.5),
        ("exponential", {}, 110, 0.1),
        ("step", {"step": {"step_size": 20, "gamma": 0.5}}, 49, 0.5),  # floor(39 / 20) = 1
        (
            "step",
            {"step": {"step_size": 20, "gamma": 0.5}},
            109,
            0.1,
        ),  # 0.5^floor(99/20) = 0.0625, floored at r
        ("inverse_sqrt", {}, 39, math.sqrt(10 / 40)),
        ("cyclic", {"cyclic": {"cycle_steps": 20}}, 10, 0.1),  # s - W = 0: bottom
        ("cyclic", {"cyclic": {"cycle_steps": 20}}, 20, 1.0),  # half a period: top
        ("cyclic", {"cyclic": {"cycle_steps": 20}}, 25, 0.1 + 0.9 * 0.5),
    ],
)
def test_formulas(name, kw, step, want):
    cfg = S(name, warmup=10, min_lr_ratio=0.1, **kw)
    # default approx: a float64 formula against its hand value (see the note at the top)
    assert lr_multiplier(cfg, step, 110) == pytest.approx(want)


def test_wsd_shapes_and_extension():
    for shape, mid in [
        ("linear", 1 - 0.9 * 0.5),
        ("cosine", 0.1 + 0.9 * 0.5),
        ("1-sqrt", 1 - 0.9 * math.sqrt(0.5)),
    ]:
        cfg = S("wsd", warmup=10, min_lr_ratio=0.1, wsd={"decay_fraction": 0.2, "decay_shape": shape})
        assert lr_multiplier(cfg, 79, 100) == 1.0  # stable until D = 100 - 20 = 80
        # default approx: float64 formulas (see the note at the top)
        assert lr_multiplier(cfg, 90, 100) == pytest.approx(mid)
        assert lr_multiplier(cfg, 100, 100) == pytest.approx(0.1)
    # a run in its stable phase extended from 100 to 200 steps: same rates so far, decay at the new end
    cfg = S("wsd", warmup=10, wsd={"decay_fraction": 0.2})
    assert [lr_multiplier(cfg, s, 100) for s in range(70)] == [lr_multiplier(cfg, s, 200) for s in range(70)]
    # default approx: float64 formula (note at the top); the stable phase is exactly 1.0
    assert lr_multiplier(cfg, 150, 200) == 1.0 and lr_multiplier(cfg, 200, 200) == pytest.approx(0.1)


def test_one_cycle():
    cfg = S("one_cycle", warmup=20, min_lr_ratio=0.01, one_cycle={"div_factor": 25})
    # default approx: float64 formulas against hand values (see the note at the top)
    assert lr_multiplier(cfg, 0, 120) == pytest.approx(1 / 25)
    assert lr_multiplier(cfg, 10, 120) == pytest.approx(1 / 25 + (1 - 1 / 25) * 0.5)
    assert lr_multiplier(cfg, 20, 120) == pytest.approx(1.0)
    assert lr_multiplier(cfg, 70, 120) == pytest.approx(0.01 + 0.99 * 0.5)
    assert lr_multiplier(cfg, 120, 120) == pytest.approx(0.01)


def test_plateau_cuts_after_patience_and_resumes():
    sched = Schedule(
        S("plateau", warmup=2, min_lr_ratio=0.2, plateau={"patience": 1, "factor": 0.5, "threshold": 0.01}),
        100,
    )
    assert sched(0) == 0.5 and sched(5) == 1.0
    for loss in [3.0, 2.9, 2.895, 2.9]:  # 2.895 is < 1% better: no improvement; two in a row > patience 1
        sched.observe(loss)
    assert sched(5) == 0.5
    state = sched.state_dict()
    for loss in [2.9, 2.9, 2.9, 2.9, 2.9, 2.9]:
        sched.observe(loss)
    assert sched(5) == 0.2  # floored at min_lr_ratio
    again = Schedule(
        S("plateau", warmup=2, min_lr_ratio=0.2, plateau={"patience": 1, "factor": 0.5, "threshold": 0.01}),
        100,
    )
    again.load_state_dict(state)
    assert again(5) == 0.5 and again.best == 2.9
