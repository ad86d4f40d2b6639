"""The pipeline planner: the grid it draws is torch's own schedule (get_schedule_ops, or the actions the
single-stage schedules' step loop runs, spaced by torch's visualizer), its bubble measured on that grid,
and lmforge's bubble_fraction beside it."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from torch.distributed.pipelining._schedule_visualizer import add_schedule_op_spacing, get_schedule_ops

from lmforge.parallel.pipeline import SCHEDULES, bubble_fraction
from lmforge.web.app import create_app
from lmforge.web.figures_pipeline import pipeline_figures, runtime_order
from tests.conftest import figure, renders, screenshot, wait_render

# Tolerances: every pytest.approx here keeps its default (1e-6 relative): the page's figures are float64
# arithmetic (JSON numbers) of the same formulas lmforge's Python computes, so the default only absorbs
# rounding in another order; the CPU does not enter.


def _torch_ops(schedule: str, pp: int, m: int, v: int) -> list[list[str | None]]:
    """torch's spaced grid; for the single-stage schedules, their pipeline_order without REDUCE_GRAD (torch
    2.13's spacer cannot take it), spaced by the same add_schedule_op_spacing."""
    with contextlib.redirect_stdout(io.StringIO()):
        if schedule in ("gpipe", "1f1b"):
            order = get_schedule_ops(SCHEDULES[schedule], pp, m, 1)
            order = [
                [a for a in r if a is not None and a.computation_type.name != "REDUCE_GRAD"] for r in order
            ]
            ops = add_schedule_op_spacing(order)
        else:
            ops = get_schedule_ops(SCHEDULES[schedule], pp, m, v, add_spacing=True)
    return [[None if a is None else str(a) for a in r] for r in ops]


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v"),
    [("gpipe", 4, 4, 1), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 4, 3), ("zbv", 4, 4, 2)],
)
def test_grid_is_torchs_schedule(schedule: str, pp: int, m: int, v: int):
    got = pipeline_figures(schedule, pp, m, v)
    assert got["ops"] == _torch_ops(schedule, pp, m, v)
    assert got["bubble_formula"] == bubble_fraction(pp, m, v)


def test_1f1b_order_is_what_its_step_loop_runs():
    """torch 2.13's Schedule1F1B.pipeline_order (a picture only) numbers the last rank's forwards 1..m; the
    page records the order its _step_microbatches runs, which equals pipeline_order on every other rank."""
    with contextlib.redirect_stdout(io.StringIO()):
        picture = get_schedule_ops("1F1B", 4, 8)
    ran = runtime_order("1f1b", 4, 8)
    for rank in range(3):
        assert [str(a) for a in ran[rank]] == [str(a) for a in picture[rank] if "REDUCE" not in str(a)]
    assert [str(a) for a in ran[3]] == [f"3{k}{i}" for i in range(8) for k in "FB"]  # warm-up of 1 forward
    got = pipeline_figures("1f1b", 4, 8)
    assert [[a for a in r if a] for r in got["ops"]] == [[str(a) for a in r] for r in ran]


def test_measured_bubble_of_gpipe_and_1f1b_is_the_formula():
    """With a backward costing two forwards, GPipe and 1F1B idle (p-1)/(m+p-1) of the step on the grid;
    zero-bubble schedules idle less."""
    for schedule, m in (("gpipe", 4), ("1f1b", 4), ("1f1b", 8)):
        f = pipeline_figures(schedule, 4, m)
        # default approx: idle / total units, a float64 quotient of integers, against the formula's
        assert f["bubble_measured"] == pytest.approx(bubble_fraction(4, m)), schedule
        assert f["makespan"] == 3 * (m + 3) and f["busy_units"] == 4 * 3 * m
    assert pipeline_figures("zero_bubble", 4, 8, 2)["bubble_measured"] < bubble_fraction(4, 8, 2)


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("schedule=1f1b&pp=4&microbatches=2", "parallel.pp_microbatches"),
        ("schedule=interleaved_1f1b&pp=4&microbatches=9&stages_per_rank=2", "parallel.pp_microbatches"),
        ("schedule=interleaved_1f1b&stages_per_rank=1", "parallel.pp_stages_per_rank"),
        ("schedule=zbv&stages_per_rank=3", "parallel.pp_stages_per_rank"),
        ("schedule=nope", "schedule"),
        ("pp=0", "pp"),
        ("microbatches=x", "microbatches"),
    ],
)
def test_bad_input_is_a_one_line_400(tmp_path: Path, query: str, needle: str):
    r = create_app(tmp_path).test_client().get(f"/api/pipeline?{query}")
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert needle in err and "\n" not in err


def test_page_draws_torchs_grid_and_follows_the_controls(tmp_path: Path, serve, page):
    url = serve(tmp_path)
    page.goto(f"{url}/pipeline")
    wait_render(page)
    assert page.input_value("[name=pp]") == "4" and page.input_value("[name=microbatches]") == "4"
    grid = json.loads(page.get_attribute("#pipeline-chart", "data-grid"))
    assert grid == pipeline_figures("1f1b", 4, 4)["ops"]
    with contextlib.redirect_stdout(io.StringIO()):
        picture = get_schedule_ops("1F1B", 4, 4)  # torch's picture: right on all ranks but the last
    for rank in range(3):
        assert [a for a in grid[rank] if a] == [str(a) for a in picture[rank] if "REDUCE" not in str(a)]
    assert figure(page, "bubble_formula") == bubble_fraction(4, 4)
    # default approx: the float64 3 / 7 the page holds (a JS number), rounding only
    assert figure(page, "bubble_measured") == pytest.approx(3 / 7)
    assert page.locator("#pipeline-chart .shapelayer path").count() > 16  # the actions are drawn
    screenshot(page, "pipeline", tmp_path)

    for schedule, v, m in (("gpipe", 2, 4), ("interleaved_1f1b", 2, 8)):
        n = renders(page)
        page.select_option("[name=schedule]", schedule)
        page.fill("[name=microbatches]", str(m))
        page.dispatch_event("[name=microbatches]", "change")
        wait_render(page, after=n)
        page.wait_for_function(
            f"document.querySelector(\"[data-key='torch_class']\").dataset.value === "
            f"'{SCHEDULES[schedule].__name__}' && document.querySelector(\"[data-key="
            f"'bubble_formula']\").dataset.value === '{bubble_fraction(4, m, 1 if schedule == 'gpipe' else v)}'"
        )
        grid = json.loads(page.get_attribute("#pipeline-chart", "data-grid"))
        assert grid == _torch_ops(schedule, 4, m, v)
        assert figure(page, "bubble_formula") == bubble_fraction(4, m, 1 if schedule == "gpipe" else v)

    n = renders(page)
    page.fill("[name=microbatches]", "9")  # interleaved: m divisible by max(1, m // pp) = 2
    page.dispatch_event("[name=microbatches]", "change")
    wait_render(page, after=n)
    error = page.locator("#error")
    assert error.is_visible() and "parallel.pp_microbatches" in error.inner_text()
    assert len(page.errors) == 1 and "400" in page.errors[0]  # the browser logs the refused request
    page.errors.clear()
