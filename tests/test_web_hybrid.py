"""The hybrid planner: the figures it shows are `lmforge estimate --json`'s for the same flags, and its GPU
grid is the device mesh parallel/layout.py builds ((pp, dp_replicate, dp_shard, tp), tp innermost)."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from lmforge.web.app import create_app
from lmforge.web.figures_hybrid import HybridInputs, mesh_coords, mesh_groups
from tests.accuracy_matrix import MATRIX, PEAK_TEXT, install
from tests.conftest import estimate_cli, figure, renders, screenshot, wait_render


def test_mesh_is_init_device_meshs_row_major_layout():
    degrees = {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 4}
    ranks = torch.arange(32).reshape(2, 2, 2, 4)  # what init_device_mesh lays out for these degrees
    for rank, c in enumerate(mesh_coords(degrees)):
        assert ranks[c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"]].item() == rank
    groups = mesh_groups(degrees, 8)
    assert [g["ranks"] for g in groups["tp"]][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["pp"][0]["ranks"] == [0, 16] and groups["dp"][0]["ranks"] == [0, 4, 8, 12]
    assert not any(g["crosses_nodes"] for g in groups["tp"])  # tp 4 stays inside a node of 8
    assert all(g["crosses_nodes"] for g in groups["pp"]) and all(g["crosses_nodes"] for g in groups["dp"])


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("tp=4", "tp x pp x dp_replicate x dp_shard"),
        ("nodes=0", "nodes"),
        ("zero=4", "zero"),
        ("checkpointing=sometimes", "checkpointing"),
        ("model=gpt5", "model"),
        ("tp=8&pp=2&dp_shard=1&dp_replicate=2", "parallel.tp"),  # DDP does not compose with TP (layout.py)
    ],
)
def test_bad_input_is_a_one_line_400(tmp_path: Path, query: str, needle: str):
    r = create_app(tmp_path).test_client().get(f"/api/hybrid?{query}")
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert needle in err and "\n" not in err


def test_page_shows_estimate_json_and_follows_the_controls(tmp_path: Path, serve, page, capsys, monkeypatch):
    url = serve(tmp_path)
    page.goto(f"{url}/hybrid")
    wait_render(page)
    seed = HybridInputs()
    assert (seed.model, seed.gpus) == ("llama-65b", 32)
    want = estimate_cli(capsys, *seed.flags())
    for key in ("total", "step_s", "compute_s", "exposed_comm_s", "bubble", "tokens_per_s", "device_params"):
        assert figure(page, key) == want[key], key
    for dim in ("dp", "tp", "pp"):
        assert figure(page, f"comm_{dim}") == want["comm"][dim], dim
    assert (figure(page, "crossing_tp"), figure(page, "crossing_pp"), figure(page, "crossing_dp")) == (
        0,
        16,
        16,
    )
    gpus = json.loads(page.get_attribute("#hybrid-grid", "data-gpus"))
    # each GPU shows its pipeline rank's total; the peak rank's is the estimate's total
    assert len(gpus) == 32 and [g["memory"] for g in gpus] == [want["pp_rank_totals"][g["pp"]] for g in gpus]
    assert max(want["pp_rank_totals"]) == want["total"] and len(want["pp_rank_totals"]) == 2
    assert page.inner_text("#hybrid-command") == f"lmforge estimate {' '.join(seed.flags())} --json"
    screenshot(page, "hybrid", tmp_path)

    install(monkeypatch, tmp_path / "plan")  # an accuracy matrix with figures of the test's choosing
    n = renders(page)  # TP 8 -> 4, DP shard 2 -> 4: less TP traffic, more DP traffic
    page.fill("[name=tp]", "4")
    page.fill("[name=dp_shard]", "4")
    page.select_option("[name=checkpointing]", "selective")
    page.dispatch_event("[name=dp_shard]", "change")
    wait_render(page, after=n)
    flags = HybridInputs(tp=4, dp_shard=4, checkpointing="selective").flags()
    page.wait_for_function(
        f"document.getElementById('hybrid-command').textContent === 'lmforge estimate {' '.join(flags)} --json'"
    )
    got = estimate_cli(capsys, *flags)
    assert figure(page, "total") == got["total"] != want["total"]
    assert page.text_content("[data-key='accuracy']") == PEAK_TEXT
    assert figure(page, "accuracy") == MATRIX["summary"]["max_abs_peak_error"]
    assert figure(page, "comm_tp") == got["comm"]["tp"] and figure(page, "comm_dp") == got["comm"]["dp"]

    n = renders(page)
    page.fill("[name=pp]", "3")  # 4 x 3 x 1 x 4 = 48, not 32
    page.dispatch_event("[name=pp]", "change")
    wait_render(page, after=n)
    assert "make them agree" in page.inner_text("#error")
    assert len(page.errors) == 1 and "400" in page.errors[0]  # the browser logs the refused request
    page.errors.clear()


def test_search_lists_the_planners_layouts(tmp_path: Path, serve, page, capsys):
    url = serve(tmp_path)
    page.goto(f"{url}/hybrid")
    wait_render(page)
    n = renders(page)
    page.check("[name=search]")
    wait_render(page, after=n)
    page.wait_for_selector("#hybrid-search-box:not([hidden])")
    want = estimate_cli(capsys, *HybridInputs().flags(), "--search", part="search")
    assert want
    for i, s in enumerate(want):
        assert figure(page, f"search_{i}_total") == s["total"]
        assert figure(page, f"search_{i}_tokens_per_s") == s["tokens_per_s"]


def _grid_drawing(page) -> tuple[list[str], list[dict], list[list[tuple[float, float]]]]:
    """The grid as drawn: each GPU's fill colour and box (rank order), and each group line's points."""
    got = page.evaluate(
        """(() => { const g = document.getElementById('hybrid-grid');
        const rects = g.layout.shapes.filter(s => s.type === 'rect');
        const lines = g.data.filter(t => t.mode === 'lines');
        return [rects.map(s => s.fillcolor), rects.map(s => ({x0: s.x0, x1: s.x1, y0: s.y0, y1: s.y1})),
                lines.map(t => t.x.map((x, i) => [x, t.y[i]]))]; })()"""
    )
    return got[0], got[1], [[tuple(p) for p in line] for line in got[2]]


def _crossed(points: list[tuple], box: dict) -> bool:
    """Whether the polyline ``points`` (None breaks it) passes inside ``box`` (sampled every 1/200th)."""
    for (x0, y0), (x1, y1) in pairwise(points):
        if None in (x0, y0, x1, y1):
            continue
        for k in range(201):
            x, y = x0 + (x1 - x0) * k / 200, y0 + (y1 - y0) * k / 200
            if box["x0"] + 1e-6 < x < box["x1"] - 1e-6 and box["y0"] + 1e-6 < y < box["y1"] - 1e-6:
                return True
    return False


def test_grid_one_colour_per_group_and_lines_only_through_the_groups_gpus(tmp_path: Path, serve, page):
    """At 4 x 8 GPUs there are 16 DP and 16 PP groups, more than a 10-colour palette: each group still gets
    a colour of its own, and a group's line never passes over a GPU outside it (the PP line of ranks 0 and
    16 went straight over rank 8; at TP 4 the DP line of ranks 0, 4, ... over ranks 1 to 3). The figures'
    names are words, not the estimate's keys."""
    page.goto(f"{serve(tmp_path)}/hybrid")
    wait_render(page)
    names = page.locator("#hybrid-figures tbody tr td:first-child").all_inner_texts()
    assert names and not [n for n in names if "_" in n], names
    for degrees in (
        {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 8},
        {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "tp": 4},
    ):
        if degrees["tp"] == 4:
            n = renders(page)
            page.fill("[name=tp]", "4")
            page.fill("[name=dp_shard]", "4")
            page.dispatch_event("[name=dp_shard]", "change")
            wait_render(page, after=n)
            page.wait_for_function("document.getElementById('hybrid-command').textContent.includes('tp=4')")
        groups = mesh_groups(degrees, 8)
        for dim in ("tp", "pp", "dp"):
            page.select_option("#hybrid-colour", dim)
            page.wait_for_function(
                f"document.getElementById('hybrid-grid').layout.title.text.endsWith('{dim.upper()} group')"
            )
            colours, boxes, lines = _grid_drawing(page)
            by_group = [{colours[r] for r in g["ranks"]} for g in groups[dim]]
            assert all(len(c) == 1 for c in by_group), (degrees, dim)
            assert len({c.pop() for c in by_group}) == len(groups[dim]), (degrees, dim)
            joined = [g["ranks"] for g in groups[dim] if len(g["ranks"]) > 1]
            assert len(lines) == len(joined)
            for ranks, line in zip(joined, lines, strict=True):
                over = [r for r in range(32) if r not in ranks and _crossed(line, boxes[r])]
                assert not over, f"{dim} group {ranks} passes over ranks {over} at {degrees}"
