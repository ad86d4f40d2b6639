"""The cleaning trade-off page: the curves of a REAL ``lmforge data sweep`` run (the tiny recipe of
tests/test_sweep.py), shown exactly as sweep.json holds them, the optimum marked by the page's stated rule,
and, without a sweep, the command that makes one instead of any curve."""

from __future__ import annotations

import json
import math
import os
from itertools import pairwise
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.corpus.sweep import optimum
from lmforge.web.app import create_app
from lmforge.web.figures_cleaning import find_sweeps
from tests.conftest import figure, renders, screenshot, wait_render
from tests.test_sweep import corpus  # noqa: F401  (the module-scoped recipe + classifier fixture)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:  # noqa: F811
    """A runs folder holding one real sweep (levels 0, 50, 100) at runs/data/tiny/sweep.json."""
    recipe, model = corpus
    root = tmp_path_factory.mktemp("runs")
    out = root / "data" / "tiny"
    argv = ["data", "sweep", "--config", str(recipe), "--out", str(out), "--levels", "0,50,100"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--reference-classifier", str(model), "--workers", "1"])
    assert exit_.value.code == 0
    return root


def _sweep(runs: Path) -> dict:
    return json.loads((runs / "data" / "tiny" / "sweep.json").read_text())


def test_find_sweeps_looks_3_folders_deep_and_not_outside(tmp_path: Path):
    root = tmp_path / "runs"
    for rel in ["sweep.json", "a/sweep.json", "a/b/c/sweep.json", "a/b/c/d/sweep.json"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "sweep.json").write_text("{}")
    os.symlink(tmp_path / "outside" / "sweep.json", root / "a" / "b" / "sweep.json")
    os.symlink(tmp_path / "outside", root / "linked")
    assert find_sweeps(root) == ["a/b/c/sweep.json", "a/sweep.json", "sweep.json"]


def test_api_serves_the_sweep_as_measured(runs: Path):
    client = create_app(runs).test_client()
    r = client.get("/api/cleaning")
    assert r.status_code == 200
    data, sweep = r.json, _sweep(runs)
    assert data["sweeps"] == ["data/tiny/sweep.json"] and data["sweep"] == "data/tiny/sweep.json"
    assert data["rows"] == sweep["rows"] and data["levels"] == [0.0, 50.0, 100.0]
    best = optimum(sweep["rows"], sweep["reference"]["higher_is_better"])
    assert data["optimum"] == best and data["index"] == best["index"]
    for query, needle in [
        ("sweep=../secret/sweep.json", "sweep"),
        ("sweep=/etc/passwd", "sweep"),
        ("sweep=data/tiny/level-000/report.json", "sweep"),
        ("level=33", "level"),
        ("w_size=-1", "w_size"),
    ]:
        r = client.get(f"/api/cleaning?{query}")
        assert r.status_code == 400, query
        assert needle in r.json["error"] and "\n" not in r.json["error"]


def test_without_a_sweep_the_page_says_how_to_make_one(tmp_path: Path, serve, page):
    assert create_app(tmp_path).test_client().get("/api/cleaning").json["sweeps"] == []
    page.goto(f"{serve(tmp_path)}/cleaning")
    text = page.inner_text("#no-sweep")
    assert "lmforge data sweep --config" in text and str(tmp_path.resolve()) in text
    assert page.locator(".chart").count() == 0


def test_page_shows_the_real_sweep_in_a_browser(runs: Path, serve, page, tmp_path: Path):
    sweep = _sweep(runs)
    rows = sweep["rows"]
    page.goto(f"{serve(runs)}/cleaning")
    wait_render(page)
    best = optimum(rows, True)["index"]
    assert (
        figure(page, "optimum.level") == rows[best]["level"] == sweep["optimum"]["level"]
    )  # what the sweep marks
    for i, row in enumerate(rows):
        for key in (
            "level",
            "documents",
            "tokens",
            "quality_mean",
            "distinct_ngrams_at_k",
            "vocab_entropy_bits",
        ):
            assert figure(page, f"row.{i}.{key}") == row[key], (i, key)
    assert figure(page, "level.documents") == rows[best]["documents"]  # the level shown starts at the optimum
    for chart in ("size", "quality", "diversity"):
        assert page.locator(f"#chart-{chart} .scatterlayer .trace").count() >= 3
    screenshot(page, "cleaning", tmp_path)

    n = renders(page)
    page.select_option("select[name=level]", "100")
    wait_render(page, after=n)
    assert figure(page, "level.documents") == rows[2]["documents"] == 30
    assert figure(page, "level.tokens") == rows[2]["tokens"]
    assert figure(page, "removed.dedup_exact.duplicate") == rows[2]["removed"]["dedup_exact.duplicate"] == 5
    n = renders(page)
    page.fill("input[name=w_quality]", "0")
    page.fill("input[name=w_diversity]", "0")
    wait_render(page, after=n)
    page.wait_for_function("document.querySelector(\"[data-key='optimum.level']\").dataset.value === '0'")
    assert figure(page, "optimum.level") == 0  # size alone: level 0 keeps the most


def test_page_states_the_sweeps_optimum_and_round_right_axis_ticks(runs: Path, serve, page):
    """The sweep marks an optimum in sweep.json: the page says which (no note that it marks none), and the
    diversity chart's right axis has round ticks of its own, clear of the optimum's star."""
    sweep = _sweep(runs)
    page.goto(f"{serve(runs)}/cleaning")
    wait_render(page)
    assert "marks none" not in page.inner_text("body")
    assert figure(page, "recorded.level") == sweep["optimum"]["level"]
    texts = page.locator("#chart-diversity .y2tick text").evaluate_all("els => els.map(e => e.textContent)")
    ticks = [float(t) for t in texts]
    steps = {round(b - a, 9) for a, b in pairwise(ticks)}
    assert len(ticks) >= 2 and len(steps) == 1, ticks
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1, 2, 2.5, 5), ticks  # 4.8, 4.85, 4.9 ... not 4.767, 4.839 ...
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks), ticks
    star = page.locator("#chart-diversity .scatterlayer .trace").nth(3).locator(".point").bounding_box()
    for box in page.locator("#chart-diversity .y2tick text").evaluate_all(
        "els => els.map(e => { const r = e.getBoundingClientRect(); return [r.left, r.right, r.top, r.bottom]; })"
    ):
        x0, x1, y0, y1 = box
        apart = (
            x1 <= star["x"]
            or star["x"] + star["width"] <= x0
            or y1 <= star["y"]
            or star["y"] + star["height"] <= y0
        )
        assert apart, (box, star)
