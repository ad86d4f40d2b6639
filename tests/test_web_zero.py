"""The ZeRO stages page: at the seed defaults (13B = llama-13b, 8 GPUs) the seed table's formulas are
``plan/memory.py`` / ``plan/comm.py``'s for the model's parameter count (DDP 16Ψ, ZeRO-3 16Ψ/N in the
ZeRO paper's accounting), the planner's rows are ``lmforge estimate --json``'s with
``parallel.dp_replicate = N`` or ``parallel.dp_shard = N`` and ``parallel.zero = 1/2/3``; a changed
control changes both; bad input is a one-line 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.plan.comm import dp_volume, seed_volume
from lmforge.plan.memory import per_param_formula
from lmforge.web.app import create_app
from tests.accuracy_matrix import PEAK_TEXT, install
from tests.conftest import estimate_cli, figure, renders, screenshot, wait_render

KINDS = {
    "ddp": ["--parallel.dp_replicate={n}"],
    "zero1": ["--parallel.dp_shard={n}", "--parallel.zero=1"],
    "zero2": ["--parallel.dp_shard={n}", "--parallel.zero=2"],
    "zero3": ["--parallel.dp_shard={n}", "--parallel.zero=3"],
}
PARTS = ("params", "grads", "master", "optim")


# Tolerances: the page's figures are float64 arithmetic (JSON numbers) of the planner's formulas, the same on
# every CPU: rel=1e-12 and 1e-6 only absorb the rounding of a formula written in another order (~1e-16
# relative). The ZeRO-1 bound (0.5%) is not rounding: it is how far whole tensors per rank put the most loaded
# rank above 1/N (llama-13b, the page's model: +0.13% at N = 8).


def planner_cli(capsys, kind: str, n: int, *flags: str) -> dict:
    layout = [f.format(n=n) for f in KINDS[kind]]
    return estimate_cli(capsys, "--model", "llama-13b", "--gpus", str(n), *flags, *layout)


def assert_tables(page, capsys, n: int, accounting: str, k: float, *flags: str) -> None:
    psi = figure(page, "psi")
    for kind in KINDS:
        e = planner_cli(capsys, kind, n, "--weights", accounting, *flags)
        assert e["n_params"] == psi
        for part in PARTS:
            assert figure(page, f"planner.{kind}.{part}") == e["states"][part], (kind, part)
        assert figure(page, f"planner.{kind}.total") == e["total"], kind
        assert figure(page, f"planner.{kind}.comm_dp") == e["comm"]["dp"], kind
        assert figure(page, f"planner.{kind}.fits") == (1.0 if e["fits"] else 0.0), kind
        formula = per_param_formula(kind, psi, n, k, accounting)
        for part in PARTS:
            assert figure(page, f"formula.{kind}.{part}") == getattr(formula, part), (kind, part)
        assert figure(page, f"formula.{kind}.comm_bytes") == 2 * seed_volume(kind, psi)
        assert figure(page, f"formula.{kind}.comm_ring_bytes") == dp_volume(
            kind, psi, n, 2, accounting="zero-paper"
        )


def test_zero_page_shows_formulas_and_planner(tmp_path: Path, serve, page, capsys, cli_logging, monkeypatch):
    url = serve(tmp_path)
    page.goto(f"{url}/zero")
    wait_render(page)
    assert page.input_value("[name=model]") == "llama-13b" and page.input_value("[name=gpus]") == "8"
    psi = figure(page, "psi")
    assert psi == 13_015_864_320
    flags = ("--train.precision=fp16", "--optim.name=adam")
    assert_tables(page, capsys, 8, "zero-paper", 8, *flags)
    # the seed table (ZeRO paper, K = 12 for mixed-precision Adam): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N
    seed = {
        "ddp": 16 * psi,
        "zero1": 4 * psi + 12 * psi / 8,
        "zero2": 2 * psi + 14 * psi / 8,
        "zero3": 16 * psi / 8,
    }
    for kind, want in seed.items():
        # rel=1e-12: float64 formulas in another order (the note at the top)
        assert figure(page, f"formula.{kind}.total") == pytest.approx(want, rel=1e-12), kind
    assert [figure(page, f"formula.{k}.comm_psi") for k in KINDS] == [2, 2, 2, 3]
    # the planner's zero-paper DDP, ZeRO-2 and ZeRO-3 states equal the formula (ZeRO-1: whole tensors per rank)
    for kind in ("ddp", "zero2", "zero3"):
        # rel=1e-6: a float64 sum over ~360 tensors against the closed formula (<= 4e-14): rounding room
        assert figure(page, f"planner.{kind}.states_total") == pytest.approx(seed[kind], rel=1e-6), kind
    assert 0 < figure(page, "planner.zero1.states_total") / seed["zero1"] - 1 < 0.005
    screenshot(page, "zero", tmp_path)

    install(monkeypatch, tmp_path / "plan")  # an accuracy matrix with figures of the test's choosing
    n = renders(page)
    page.fill("[name=gpus]", "16")
    wait_render(page, after=n)
    page.wait_for_function("document.getElementById('zero-command').textContent.includes('dp_shard=16')")
    assert page.text_content("#zero-accuracy") == (
        f"Device total, the planner's measured accuracy: {PEAK_TEXT} (docs/memory-accuracy.md)."
    )
    # rel=1e-12: float64 (the note at the top)
    assert figure(page, "formula.zero3.total") == pytest.approx(16 * psi / 16, rel=1e-12)
    assert_tables(page, capsys, 16, "zero-paper", 8, *flags)

    n = renders(page)
    page.select_option("[name=accounting]", "lmforge")
    page.select_option("[name=optimizer]", "lion")
    page.select_option("[name=precision]", "bf16")
    wait_render(page, after=n)
    page.wait_for_function("document.getElementById('zero-command').textContent.includes('lion')")
    assert_tables(page, capsys, 16, "lmforge", 4, "--train.precision=bf16", "--optim.name=lion")


@pytest.mark.parametrize(
    ("query", "name"),
    [("gpus=1", "gpus"), ("gpus=two", "gpus"), ("accounting=paper", "accounting"), ("model=x", "model")],
)
def test_zero_api_bad_input_is_a_one_line_400(tmp_path: Path, query: str, name: str):
    r = create_app(tmp_path).test_client().get(f"/api/zero?{query}")
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert err.startswith(name) and "\n" not in err
