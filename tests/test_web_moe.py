"""The MoE visualizer (``/moe``): the compute formula against a hand computation, the gating the page shows
against the trained model's routers run directly here (softmax of the router's logits, top-k, in float64),
bad input refused in one line, and in a real browser the seed's defaults (8 experts, 2 per token, 4
inputs), the gating, sparsity and compute shown, and a change of experts per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.web.app import create_app
from lmforge.web.figures_moe import EXAMPLES, RECIPE, moe_flops_per_token, trained_model
from tests.conftest import figure, renders, screenshot, wait_render


def router_choice(model, text: str, block: int) -> tuple[list[list[int]], list[list[float]]]:
    """The experts and gate weights of each byte of ``text`` at block ``block``'s MoE layer, computed here:
    the layer's input caught in a forward of the model, softmax of ``x W_r^T`` in float64, top-k."""
    layer = model.blocks[str(block)].mlp
    caught = {}
    hook = layer.register_forward_hook(lambda _m, args, _out: caught.__setitem__("x", args[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([list(text.encode("utf-8"))]))
    finally:
        hook.remove()
    x = caught["x"].reshape(-1, caught["x"].shape[-1]).double()
    probs = torch.softmax(x @ layer.router.weight.double().T, dim=-1)
    weights, experts = probs.topk(layer.top_k, dim=-1)
    return experts.tolist(), weights.tolist()


def flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def test_compute_saved_by_hand():
    # N = 1000 of which 800 in routed experts, 8 experts, 2 per token, 2 layers, d = 4, T = 8
    got = moe_flops_per_token(1000, 800, 8, 2, 2, 4, 8)
    # active 1000 - 800 * 6/8 = 400; attention 12 * 2 * 4 * 8 = 768
    assert got["active_params"] == 400
    assert got["moe_flops"] == 6 * 400 + 768 == 3168
    assert got["dense_flops"] == 6 * 1000 + 768 == 6768
    # float64 arithmetic on integers: one division and a subtraction, ~1e-16; rel 1e-12 is rounding room
    assert got["saved"] == pytest.approx(1 - 3168 / 6768, rel=1e-12)
    assert got["sparsity"] == 0.25


def test_api_gating_is_the_trained_routers_top_k(tmp_path: Path):
    client = create_app(tmp_path).test_client()
    r = client.get("/api/moe")
    assert r.status_code == 200
    body = r.get_json()
    assert (body["experts"], body["top_k"], len(body["inputs"])) == (8, 2, 4)
    model, info = trained_model(8, 2)
    assert info["losses"][1] < info["losses"][0] - 1.5  # it learned (ln 256 = 5.55 nats at the start)
    for inp, text in zip(body["inputs"], EXAMPLES, strict=True):
        assert inp["text"] == text
        for layer in inp["layers"]:
            experts, weights = router_choice(model, text, layer["layer"])
            assert layer["experts"] == experts
            # the page's FP32 router (64-wide logits, ~sqrt(64) x 6e-8 of their size) and softmax against
            # float64 here: a few 1e-7 relative on each weight; rel 1e-5 leaves 10x+
            assert flat(layer["weights"]) == pytest.approx(flat(weights), rel=1e-5)
            assert "".join(layer["tokens"]) == text
    used = {e for inp in body["inputs"] for es in inp["layers"][0]["experts"] for e in es}
    assert len(used) >= 3  # the tokens do not all go to the same two experts
    # parameters counted on the model itself: every parameter but the (tied) embedding counts once
    c = body["compute"]
    n = sum(p.numel() for p in model.parameters())
    assert c["total_params"] == n  # tied embedding = the output head: it counts
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert c["routed_params"] == routed == RECIPE.n_layers * 8 * 3 * RECIPE.d_model * RECIPE.d_expert
    assert c["active_params"] == n - routed * 6 / 8 and c["sparsity"] == 0.25


@pytest.mark.parametrize(
    ("query", "needle"),
    [("experts=1", "experts"), ("top_k=9", "top_k"), ("experts=x", "experts"), ("input2=", "input2"),
     ("input1=" + "a" * 65, "input1")],
)  # fmt: skip
def test_api_bad_input_is_400_one_line(tmp_path: Path, query: str, needle: str):
    r = create_app(tmp_path).test_client().get(f"/api/moe?{query}")
    assert r.status_code == 400
    assert r.get_json()["error"].startswith(needle) and "\n" not in r.get_json()["error"]


def _routes(page, i: int, layer: int, n: int) -> list[list]:
    return [
        json.loads(page.get_attribute(f"[data-key='route.{i}.{layer}.{p}']", "data-value")) for p in range(n)
    ]


def test_page_shows_the_real_gating_sparsity_and_savings(tmp_path: Path, serve, page):
    page.goto(f"{serve(tmp_path)}/moe")
    wait_render(page, timeout_ms=120000)
    assert page.input_value("input[name=experts]") == "8" and page.input_value("input[name=top_k]") == "2"
    assert [page.input_value(f"input[name=input{i}]") for i in range(4)] == list(EXAMPLES)
    assert page.locator("#moe-inputs .moe-input").count() == 4
    model, _ = trained_model(8, 2)
    for i, text in enumerate(EXAMPLES):
        experts, weights = router_choice(model, text, 0)
        shown = _routes(page, i, 0, len(text))
        assert [[e for e, _ in row] for row in shown] == experts
        # the page's FP32 gate weights against float64 here: a few 1e-7 (the API test); rel 1e-5 is 10x+
        assert [w for row in shown for _, w in row] == pytest.approx(flat(weights), rel=1e-5)
    assert figure(page, "compute.sparsity") == 0.25
    n = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    expected = moe_flops_per_token(n, routed, 8, 2, RECIPE.n_layers, RECIPE.d_model, RECIPE.seq_len)
    # the same float64 formula on both sides, through JSON (exact round trip): rel 1e-12 is rounding room
    assert figure(page, "compute.saved") == pytest.approx(expected["saved"], rel=1e-12)
    assert page.evaluate("document.getElementById('chart-moe-gate-0').data[0].type") == "heatmap"
    screenshot(page, "moe", tmp_path)

    n_renders = renders(page)
    page.fill("input[name=top_k]", "1")
    wait_render(page, after=n_renders, timeout_ms=120000)
    assert figure(page, "compute.sparsity") == 0.125
    model1, _ = trained_model(8, 1)
    n_renders = renders(page)
    page.select_option("select[name=layer]", "1")
    wait_render(page, after=n_renders)
    experts, weights = router_choice(model1, EXAMPLES[3], 1)
    shown = _routes(page, 3, 1, len(EXAMPLES[3]))
    assert [[e for e, _ in row] for row in shown] == experts and all(len(row) == 1 for row in shown)
    assert figure(page, "compute.saved") > expected["saved"]  # one expert of 8 saves more than two
