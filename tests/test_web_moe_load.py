"""The training dashboard's MoE load heatmap (``/runs``): the API gives a real tiny MoE run's logged loads
per layer and expert at each step (nothing for a dense run), and in a real browser the heatmap shows the
newest step's loads and, moved with the slider, an earlier step's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lmforge.web.app import create_app
from tests.conftest import screenshot, wait_render


def _steps(run: Path) -> list[dict]:
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "tokens_per_s" in r]


def test_moe_load_api_gives_the_logged_loads(moe_run: Path, tmp_path: Path):
    client = create_app(moe_run.parent).test_client()
    r = client.get("/api/runs/moe-load", query_string={"run": "moe"})
    assert r.status_code == 200
    body = r.get_json()
    steps = _steps(moe_run)
    assert body["layers"] == [0, 1] and body["experts"] == 4
    assert body["steps"] == [s["step"] for s in steps] == list(range(1, 13))
    assert body["load"] == [[s["moe/layer.0/load"], s["moe/layer.1/load"]] for s in steps]
    assert body["imbalance"][-1] == [steps[-1]["moe/layer.0/imbalance"], steps[-1]["moe/layer.1/imbalance"]]
    # a dense run (the same folder without its MoE keys) has nothing to draw
    dense = tmp_path / "dense"
    dense.mkdir()
    shutil.copy(moe_run / "config.toml", dense / "config.toml")
    lines = [{k: v for k, v in s.items() if not k.startswith("moe/")} for s in steps]
    (dense / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines))
    body = create_app(tmp_path).test_client().get("/api/runs/moe-load?run=dense").get_json()
    assert body["steps"] == [] and body["layers"] == []
    bad = create_app(tmp_path).test_client().get("/api/runs/moe-load?run=../x")
    assert bad.status_code == 400 and bad.get_json()["error"].startswith("run")


def test_dashboard_shows_the_moe_load_heatmap(moe_run: Path, serve, page, tmp_path: Path):
    steps = _steps(moe_run)
    page.goto(f"{serve(moe_run.parent)}/runs")
    wait_render(page)
    page.wait_for_function("document.body.dataset.moeStep === '12'", timeout=20000)
    assert page.is_visible("#chart-moe-load")
    z = page.evaluate("document.getElementById('chart-moe-load').data[0].z")
    assert z == [steps[-1]["moe/layer.0/load"], steps[-1]["moe/layer.1/load"]]
    assert page.evaluate("document.getElementById('chart-moe-load').data[0].type") == "heatmap"
    screenshot(page, "runs-moe", tmp_path)
    page.evaluate(
        "(() => { const s = document.getElementById('moe-load-step'); s.value = '0';"
        " s.dispatchEvent(new Event('input')); })()"
    )
    page.wait_for_function("document.body.dataset.moeStep === '1'", timeout=5000)
    assert page.get_attribute("[data-key='moe-load-step']", "data-value") == "1"
    z = page.evaluate("document.getElementById('chart-moe-load').data[0].z")
    assert z == [steps[0]["moe/layer.0/load"], steps[0]["moe/layer.1/load"]]
    # unticking the run hides the heatmap
    page.uncheck("input[name=sel][value='moe']")
    page.wait_for_selector("#moe-load", state="hidden", timeout=5000)
