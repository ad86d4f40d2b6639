"""The LR-schedules page: the seed's four curves at 10,000 steps with the warmup shaded, every lmforge
schedule on demand, and every value shown equal to lmforge's own Schedule for the same [schedule] table."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.config import ScheduleConfig
from lmforge.optim.schedules import SCHEDULE_NAMES, Schedule, lr_multiplier
from lmforge.web.app import create_app
from lmforge.web.figures_schedules import SERIES, sample_steps
from tests.conftest import figure, renders, screenshot, wait_render

# Tolerances: the pytest.approx here keeps its default (1e-6 relative): the page's learning rates are float64
# arithmetic (JSON numbers) of the formulas of lmforge/optim/schedules.py, the same on every CPU; the default
# only absorbs rounding in another order.


def test_every_lmforge_schedule_is_offered():
    assert {s.name for s in SERIES} == set(SCHEDULE_NAMES)


def test_sample_steps_keep_the_boundaries():
    steps = sample_steps(10_000, [1000, 8000])
    assert steps[0] == 0 and steps[-1] == 9999 and {999, 1000, 7999, 8000} <= set(steps)
    assert len(steps) < 1100


def test_api_values_are_lmforges_schedule(tmp_path: Path):
    client = create_app(tmp_path).test_client()
    keys = "&".join(f"{s.key}=1" for s in SERIES)
    r = client.get(
        f"/api/schedules?{keys}&peak_lr=0.001&warmup=500&min_lr_ratio=0.05&probe=7321&plateau_stall=3000"
    )
    assert r.status_code == 200
    data = r.json
    assert data["warmup_steps"] == 500 and data["probes"] == [0, 499, 500, 7321, 9999]
    assert [s["key"] for s in data["series"]] == [s.key for s in SERIES]
    for s in data["series"]:
        cfg = ScheduleConfig(**s["config"])
        assert cfg.name == s["name"] and cfg.min_lr_ratio == 0.05
        assert cfg.warmup == (0 if s["key"] in ("constant", "linear", "cosine") else 500)
        if s["name"] != "plateau":
            for step, lr in zip(s["x"], s["lr"], strict=True):
                assert lr == 0.001 * lr_multiplier(cfg, step, 10_000)
    # plateau: the trainer's order (observe after every 250 steps) on the assumed loss, replayed here
    plateau = next(s for s in data["series"] if s["name"] == "plateau")
    sched = Schedule(ScheduleConfig(**plateau["config"]), 10_000)
    expected = {}
    for step in range(10_000):
        expected[step] = 0.001 * sched(step)
        if (step + 1) % 250 == 0 and step + 1 < 10_000:
            sched.observe(0.99 ** (min(step + 1, 3000) // 250))
    assert plateau["probes"] == {str(p): expected[p] for p in data["probes"]}
    assert expected[2999] == 0.001 and expected[9999] == pytest.approx(0.001 * 0.05)  # cut down to the floor


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("steps=abc", "steps"),
        ("steps=0", "steps"),
        ("warmup=2.5", "warmup"),
        ("min_lr_ratio=2", "min_lr_ratio"),
        ("exponential=1&min_lr_ratio=0", "min_lr_ratio"),
        ("wsd_decay_shape=square", "wsd_decay_shape"),
        ("cosine=yes", "cosine"),
        ("probe=10000", "probe"),
    ],
)
def test_api_bad_input_is_400_one_line(tmp_path: Path, query: str, needle: str):
    r = create_app(tmp_path).test_client().get(f"/api/schedules?{query}")
    assert r.status_code == 400
    assert needle in r.json["error"] and "\n" not in r.json["error"]


def test_page_shows_lmforges_schedules_in_a_browser(tmp_path: Path, serve, page):
    page.goto(f"{serve(tmp_path)}/schedules")
    wait_render(page)
    # the seed: constant, linear decay, cosine, warmup + linear over 10,000 steps, 1,000 warmup steps
    assert page.input_value("input[name=steps]") == "10000"
    checked = page.locator("fieldset input[type=checkbox]:checked").evaluate_all(
        "els => els.map(e => e.name)"
    )
    assert checked == ["constant", "linear", "cosine", "warmup_linear"]
    assert page.locator("#chart-lr .scatterlayer .trace").count() == 4
    assert page.locator("#chart-lr .shapelayer path").count() >= 1  # the warmup region
    cfg = ScheduleConfig(name="linear", warmup=1000, min_lr_ratio=0.1)
    for step in (0, 999, 1000, 5000, 9999):
        assert figure(page, f"lr.warmup_linear.{step}") == 3e-4 * lr_multiplier(cfg, step, 10_000)
    cosine = ScheduleConfig(name="cosine", warmup=0, min_lr_ratio=0.1)
    assert figure(page, "lr.cosine.5000") == 3e-4 * lr_multiplier(cosine, 5000, 10_000)
    screenshot(page, "schedules", tmp_path)

    n = renders(page)
    page.check("input[name=wsd]")
    wait_render(page, after=n)
    n = renders(page)
    page.fill("input[name=probe]", "9000")
    wait_render(page, after=n)
    assert page.locator("#chart-lr .scatterlayer .trace").count() == 5
    wsd = ScheduleConfig(name="wsd", warmup=1000, min_lr_ratio=0.1)
    assert figure(page, "lr.wsd.9000") == 3e-4 * lr_multiplier(wsd, 9000, 10_000)
    assert figure(page, "lr.wsd.9000") < 3e-4  # in its 1-sqrt decay
    n = renders(page)
    page.fill("input[name=warmup]", "2000")
    wait_render(page, after=n)
    n = renders(page)
    page.fill("input[name=probe]", "1000")
    wait_render(page, after=n)
    assert figure(page, "lr.warmup_linear.1999") == 3e-4
    assert figure(page, "lr.warmup_linear.1000") == 3e-4 * (1001 / 2000)  # (s + 1) / W
