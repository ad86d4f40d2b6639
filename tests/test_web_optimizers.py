"""The optimizer-comparison page: lmforge's own optimizers on 2-D test functions; the final point the page
shows is the one a direct run of the same optimizer (built by lmforge's optimizer_factory) reaches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.config import OptimConfig, SGDConfig
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.build import optimizer_factory
from lmforge.optim.lion import Lion
from lmforge.plan.memory import state_bytes_per_param
from lmforge.web.app import create_app
from lmforge.web.figures_optimizers import FUNCTIONS, OPTIMIZERS, make_optimizer, optim_config
from tests.conftest import figure, renders, screenshot, wait_render


def direct_run(function: str, cfg: OptimConfig, start: tuple[float, float], steps: int) -> list[float]:
    """The same optimizer built here by optimizer_factory, stepping the same point on the same function."""
    p = torch.tensor(start, dtype=torch.float32, requires_grad=True)
    opt = optimizer_factory(cfg, torch.device("cpu"))([{"params": [p], "weight_decay": cfg.weight_decay}])
    for _ in range(steps):
        opt.zero_grad()
        FUNCTIONS[function].fn(p[0], p[1]).backward()
        opt.step()
    return p.detach().tolist()


def test_the_page_uses_lmforges_optimizer_classes():
    p = torch.zeros(2, requires_grad=True)
    kinds = {o.key: type(make_optimizer(optim_config(o, 0.1, 0.1), p)) for o in OPTIMIZERS}
    assert kinds == {
        "sgd": torch.optim.SGD,
        "sgd_momentum": torch.optim.SGD,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "adafactor": Adafactor,
        "lion": Lion,
    }
    assert make_optimizer(optim_config(OPTIMIZERS[1], 0.1, 0.0), p).defaults["momentum"] == 0.9


@pytest.mark.parametrize("function", sorted(FUNCTIONS))
def test_api_final_points_equal_a_direct_run(tmp_path: Path, function: str):
    r = create_app(tmp_path).test_client().get(f"/api/optimizers?function={function}&steps=30")
    assert r.status_code == 200
    data = r.json
    t = FUNCTIONS[function]
    assert [run["key"] for run in data["runs"]] == [o.key for o in OPTIMIZERS]
    for run in data["runs"]:
        choice = next(o for o in OPTIMIZERS if o.key == run["key"])
        cfg = OptimConfig(name=choice.name, lr=t.lr[run["key"]], sgd=SGDConfig(momentum=choice.momentum))
        assert [run["final_x"], run["final_y"]] == direct_run(function, cfg, t.start, 30)
        assert len(run["x"]) == 31 and run["x"][0] == t.start[0]
        assert run["memory"]["k"] == state_bytes_per_param("sgd0" if choice.momentum == 0 else choice.name)


def test_api_bad_input_is_400_one_line(tmp_path: Path):
    client = create_app(tmp_path).test_client()
    for query, needle in [
        ("function=sphere", "function"),
        ("steps=0", "steps"),
        ("lr_adam=-1", "lr_adam"),
        ("x0=nan", "x0"),
        ("lion=2", "lion"),
        ("weight_decay=abc", "weight_decay"),
    ]:
        r = client.get(f"/api/optimizers?{query}")
        assert r.status_code == 400, query
        assert needle in r.json["error"] and "\n" not in r.json["error"]


def test_page_runs_the_seed_comparison_in_a_browser(tmp_path: Path, serve, page):
    page.goto(f"{serve(tmp_path)}/optimizers")
    wait_render(page)
    checked = page.locator("fieldset input[type=checkbox]:checked").evaluate_all(
        "els => els.map(e => e.name)"
    )
    assert checked == [o.key for o in OPTIMIZERS]
    assert page.input_value("input[name=steps]") == "100"
    assert page.input_value("select[name=function]") == "rosenbrock"
    t = FUNCTIONS["rosenbrock"]
    adamw = OptimConfig(name="adamw", lr=t.lr["adamw"])
    x, y = direct_run("rosenbrock", adamw, t.start, 100)
    assert (figure(page, "final_x.adamw"), figure(page, "final_y.adamw")) == (x, y)
    assert figure(page, "mem_k.adam") == 8 and figure(page, "mem_k.lion") == 4
    assert figure(page, "mem_run.adam") == (2 * 2 * 4 + 4) / 2  # two FP32 moments of 2 values + a step
    # a contour, the minimum, and six trajectories
    assert page.locator("#chart-path .scatterlayer .trace").count() == 7
    screenshot(page, "optimizers", tmp_path)

    n = renders(page)
    page.select_option("select[name=function]", "himmelblau")
    wait_render(page, after=n)
    h = FUNCTIONS["himmelblau"]
    assert page.input_value("input[name=lr_lion]") == str(h.lr["lion"])
    lion = OptimConfig(name="lion", lr=h.lr["lion"])
    x, y = direct_run("himmelblau", lion, h.start, 100)
    assert (figure(page, "final_x.lion"), figure(page, "final_y.lion")) == (x, y)
    n = renders(page)
    page.uncheck("input[name=adafactor]")
    wait_render(page, after=n)
    assert page.locator("[data-key='final_x.adafactor']").count() == 0
    assert page.locator("#chart-path .scatterlayer .trace").count() == 6


def drawn_colours(page, chart: str) -> dict[str, str]:
    """The line colour Plotly drew (``_fullData``, defaults resolved) of each line trace of ``chart``."""
    return page.evaluate(
        f"Object.fromEntries(document.getElementById('{chart}')._fullData"
        ".filter(t => t.type === 'scatter' && t.mode.includes('lines')).map(t => [t.name, t.line.color]))"
    )


def test_an_optimizer_has_one_colour_in_both_charts(tmp_path: Path, serve, page):
    page.goto(f"{serve(tmp_path)}/optimizers")
    wait_render(page)
    path, loss = drawn_colours(page, "chart-path"), drawn_colours(page, "chart-loss")
    assert len(path) == len(OPTIMIZERS) and path == loss
    assert len(set(path.values())) == len(OPTIMIZERS)
    n = renders(page)
    page.uncheck("input[name=sgd]")  # the others keep their colours
    wait_render(page, after=n)
    after = drawn_colours(page, "chart-loss")
    assert after == drawn_colours(page, "chart-path") == {k: v for k, v in path.items() if k in after}
    assert len(after) == len(OPTIMIZERS) - 1
