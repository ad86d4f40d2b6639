"""The data-, model- and tensor-parallel planner pages: their figures are lmforge's own (plan/comm.py,
plan/memory.param_count, parallel/pipeline.stage_layers and bubble_fraction, lmforge estimate's comm.dp),
the ring schedule they animate really all-reduces, the tensor-parallel shards really multiply to the
unsplit product, the animations advance in a real browser, and bad input is a one-line 400."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lmforge.parallel.pipeline import bubble_fraction, stage_layers
from lmforge.plan import comm, models
from lmforge.plan.memory import param_count
from lmforge.plan.request import EstimateRequest, estimate_json
from lmforge.web.app import create_app
from lmforge.web.figures_parallel import ring_all_reduce_steps
from tests.conftest import figure, renders, screenshot, wait_render


@pytest.fixture
def client(tmp_path: Path):
    return create_app(tmp_path).test_client()


def gpt2_params() -> int:
    named = models.get("gpt2-124m")
    return param_count(named.model, named.vocab_size, named.seq_len)


# ---- the computation, through the API ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_ring_schedule_sums_every_chunk_on_every_gpu(n: int):
    # GPU g starts with the value 10**g in every chunk; after the schedule every GPU must hold the sum
    values = [[10.0**g] * n for g in range(n)]
    steps = ring_all_reduce_steps(n)
    for step in steps:
        before = [row[:] for row in values]
        for s in step["sends"]:
            got = before[s["src"]][s["chunk"]]
            if step["phase"] == "reduce-scatter":
                values[s["dst"]][s["chunk"]] += got
            else:
                values[s["dst"]][s["chunk"]] = got
    total = sum(10.0**g for g in range(n))
    assert all(v == total for row in values for v in row)
    # every GPU sends one chunk (X / n) per step: 2 (n - 1) / n * X, comm.all_reduce
    assert len(steps) == 2 * (n - 1)
    assert all(sorted(s["src"] for s in step["sends"]) == list(range(n)) for step in steps)
    assert len(steps) * (1.0 / n) == pytest.approx(comm.all_reduce(1.0, n))  # float64 formula: rounding only


def test_data_parallel_api_is_plan_comm_and_estimate(client):
    d = client.get("/api/data-parallel?gpus=4&batch=32&model=gpt2-124m&grad_dtype=fp32").get_json()
    p = gpt2_params()
    assert d["params"] == p and d["micro_batch"] == 8
    assert d["all_reduce_bytes"] == comm.all_reduce(4 * p, 4)
    assert d["reduce_scatter_bytes"] == comm.reduce_scatter(4 * p, 4) == d["all_gather_bytes"]
    assert d["lmforge_ddp_bytes"] == comm.dp_volume("ddp", p, 4, 4)
    est = estimate_json(EstimateRequest(model="gpt2-124m", gpus=4, overrides=("--parallel.dp_replicate=4",)))[
        "estimate"
    ]
    assert est["n_params"] == p
    assert d["all_reduce_bytes"] == est["comm"]["dp"]  # FP32 gradients: what lmforge estimate reports
    half = client.get("/api/data-parallel?gpus=8&batch=32&model=gpt2-124m&grad_dtype=bf16").get_json()
    assert half["all_reduce_bytes"] == comm.all_reduce(2 * p, 8)
    custom = client.get("/api/data-parallel?model=custom&params_m=1.5&gpus=2&batch=4").get_json()
    assert custom["params"] == 1_500_000 and custom["all_reduce_bytes"] == comm.all_reduce(6_000_000, 2)


@pytest.mark.parametrize(("layers", "gpus"), [(12, 4), (13, 4), (5, 5), (7, 1)])
def test_model_parallel_api_is_stage_layers_pp_volume_and_bubble(client, layers: int, gpus: int):
    d = client.get(
        f"/api/model-parallel?layers={layers}&gpus={gpus}&batch=8&seq=512&d_model=768&dtype_bytes=2"
    ).get_json()
    assert d["stages"] == [[r.start, r.stop] for r in stage_layers(layers, gpus)]
    assert d["activation_bytes"] == 8 * 512 * 768 * 2
    assert d["boundary_bytes"] == comm.pp_volume(gpus, 8 * 512, 768, 2)
    assert d["bubble"] == bubble_fraction(gpus, 1)
    # the drawn timeline's mean idle share: a float64 mean of a few exact fractions, so 1e-12 is rounding
    assert d["idle_mean"] == pytest.approx(bubble_fraction(gpus, 1), abs=1e-12)
    busy = {g: sum(t["duration"] for t in d["timeline"] if t["gpu"] == g) for g in range(gpus)}
    assert busy == {g: 3.0 * len(r) for g, r in enumerate(stage_layers(layers, gpus))}


def test_tensor_parallel_api_is_plan_comm_and_shards_multiply_back(client):
    d = client.get("/api/tensor-parallel?m=4096&k=4096&n=4096&gpus=2&dtype_bytes=2").get_json()
    mn, mk = 4096 * 4096 * 2, 4096 * 4096 * 2
    assert d["column"]["w_shard"] == [4096, 2048] and d["row"]["w_shard"] == [2048, 4096]
    assert d["flops_per_gpu"] == 2 * 4096**3 / 2
    assert d["column"]["forward_bytes"] == comm.all_gather(mn, 2)
    assert d["row"]["forward_bytes"] == comm.all_reduce(mn, 2)
    assert d["mlp"]["forward_bytes"] == d["mlp"]["backward_bytes"] == comm.all_reduce(mk, 2)
    # the MLP pair's two all-reduces are half a block's (attention + MLP) tensor-parallel volume
    assert 2 * d["mlp"]["forward_bytes"] == comm.tp_volume(2, 1, 4096, 4096, 0, 2, head=False) / 2
    check = d["check"]
    assert check["dims"] == [512, 512, 512]
    # FP32 products of 512-term sums in another order: the largest difference, over this call, the small
    # one below and gpus = 4, measured 4.4e-7 of the scale (2-core AVX-512-BF16 EPYC; the same with ATen's
    # AVX2 and scalar kernels, 1 and 2 threads); FP32's unit roundoff 6e-8 times sqrt(512) ~ 23 gives
    # 1.4e-6 for a random-walk sum. 1e-5 leaves 20x the measurement; a wrong shard is off by O(1)
    for key in ("column_max_diff", "row_max_diff", "mlp_max_diff"):
        assert check[key] < 1e-5 * check["scale"], key
    small = client.get("/api/tensor-parallel?m=64&k=96&n=48&gpus=3&dtype_bytes=4").get_json()
    assert small["check"]["dims"] == [64, 96, 48] and small["row"]["x_shape"] == [64, 32]
    # the same FP32 bound as above (a 96-term sum: below the 512-term one's random walk)
    assert small["check"]["row_max_diff"] < 1e-5 * small["check"]["scale"]


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("/api/data-parallel?gpus=4&batch=30", "batch"),
        ("/api/data-parallel?gpus=abc", "gpus"),
        ("/api/data-parallel?model=gpt5", "model"),
        ("/api/data-parallel?model=custom&params_m=0", "params_m"),
        ("/api/model-parallel?layers=3&gpus=4", "gpus"),
        ("/api/model-parallel?d_model=0", "d_model"),
        ("/api/tensor-parallel?k=4095&gpus=2", "k"),
        ("/api/tensor-parallel?k=99&n=100&gpus=3", "n"),
    ],
)
def test_bad_input_is_a_one_line_400_naming_the_parameter(client, url: str, needle: str):
    r = client.get(url)
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert err.startswith(f"{needle}:") and "\n" not in err


# ---- in a real browser ------------------------------------------------------------------------------


def values(page) -> dict[str, str]:
    return page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('[data-key]')].map(e => [e.dataset.key, e.dataset.value]))"
    )


def assert_animates(page, svg_id: str) -> None:
    """The animation shows a new phase within a few seconds (data-frame counts phases shown)."""
    frame = int(page.get_attribute(f"#{svg_id}", "data-frame"))
    phase = page.get_attribute(f"#{svg_id}", "data-phase")
    page.wait_for_function(
        f"Number(document.getElementById('{svg_id}').dataset.frame) >= {frame + 2}", timeout=8000
    )
    assert page.get_attribute(f"#{svg_id}", "data-phase") != phase


def change(page, name: str, value: str) -> None:
    n = renders(page)
    page.fill(f"#controls [name={name}]", value)
    wait_render(page, after=n)


def test_data_parallel_page(serve, page, tmp_path: Path):
    page.goto(f"{serve(tmp_path)}/data-parallel")
    wait_render(page)
    p = gpt2_params()
    assert figure(page, "micro_batch") == 8
    assert figure(page, "params") == p
    assert figure(page, "all_reduce_bytes") == comm.all_reduce(4 * p, 4)
    assert figure(page, "reduce_scatter_bytes") == comm.reduce_scatter(4 * p, 4)
    assert figure(page, "ring_step_count") == 6
    assert_animates(page, "dp-anim")
    # "next phase" pauses and steps through one whole cycle: split, forward, backward, the 2 (n - 1) ring
    # steps, update; at the update every GPU's every chunk holds the sum of all 4 GPUs' gradients
    seen = []
    for _ in range(10):
        page.click("#step")
        seen.append(page.get_attribute("#dp-anim", "data-phase"))
    ring = [f"reduce-scatter-{s}" for s in (1, 2, 3)] + [f"all-gather-{s}" for s in (1, 2, 3)]
    assert sorted(seen) == sorted(["split", "forward", "backward", *ring, "update"])
    while page.get_attribute("#dp-anim", "data-phase") != "update":
        page.click("#step")
    counts = page.eval_on_selector_all(
        "#dp-anim [data-count]", "els => els.map(e => Number(e.dataset.count))"
    )
    assert counts == [4] * 16
    screenshot(page, "data-parallel", tmp_path)
    before = values(page)
    change(page, "gpus", "8")
    assert figure(page, "micro_batch") == 4
    assert figure(page, "all_reduce_bytes") == comm.all_reduce(4 * p, 8)
    assert values(page) != before
    n = renders(page)
    page.select_option("#controls [name=grad_dtype]", "bf16")
    wait_render(page, after=n)
    assert figure(page, "all_reduce_bytes") == comm.all_reduce(2 * p, 8)
    change(page, "batch", "30")  # not divisible by 8: the one-line error, figures kept
    assert page.is_visible("#error") and page.inner_text("#error").startswith("batch:")
    # the browser logs the expected 400 response as a console error; nothing else may be there
    page.errors[:] = [e for e in page.errors if "status of 400" not in e]


def test_model_parallel_page(serve, page, tmp_path: Path):
    page.goto(f"{serve(tmp_path)}/model-parallel")
    wait_render(page)
    assert [figure(page, f"stage_{g}_layers") for g in range(4)] == [3, 3, 3, 3]
    assert figure(page, "activation_bytes") == 8 * 512 * 768 * 2
    assert figure(page, "boundary_bytes") == comm.pp_volume(4, 8 * 512, 768, 2)
    assert figure(page, "bubble") == bubble_fraction(4, 1) == 0.75
    assert figure(page, "idle_mean") == 0.75
    assert_animates(page, "mp-anim")
    busy = page.eval_on_selector_all("#mp-anim [data-busy='1']", "els => els.length")
    assert busy <= 1  # one GPU at a time
    assert page.locator("#mp-timeline .main-svg").count() > 0
    screenshot(page, "model-parallel", tmp_path)
    change(page, "layers", "13")
    stages = stage_layers(13, 4)
    assert [figure(page, f"stage_{g}_layers") for g in range(4)] == [len(r) for r in stages]
    change(page, "gpus", "6")
    assert figure(page, "bubble") == bubble_fraction(6, 1)
    assert figure(page, "total_bytes") == 5 * comm.pp_volume(6, 8 * 512, 768, 2)


def test_tensor_parallel_page(serve, page, tmp_path: Path):
    page.goto(f"{serve(tmp_path)}/tensor-parallel")
    wait_render(page)
    mn = 4096 * 4096 * 2
    assert page.get_attribute("[data-key='column_w_shard']", "data-value") == "4096x2048"
    assert page.get_attribute("[data-key='row_w_shard']", "data-value") == "2048x4096"
    assert figure(page, "flops_per_gpu") == 4096**3
    assert figure(page, "column_forward_bytes") == comm.all_gather(mn, 2)
    assert figure(page, "row_forward_bytes") == comm.all_reduce(mn, 2)
    assert figure(page, "mlp_forward_all_reduces") == 1 and figure(page, "mlp_backward_all_reduces") == 1
    assert figure(page, "block_tp_volume") == comm.tp_volume(2, 1, 4096, 4096, 0, 2, head=False)
    # the bound is measured and explained in test_tensor_parallel_api_is_plan_comm_and_shards_multiply_back
    for key in ("check_column", "check_row", "check_mlp"):
        assert figure(page, key) < 1e-5 * figure(page, "check_scale")
    assert_animates(page, "tp-anim")
    screenshot(page, "tensor-parallel", tmp_path)
    change(page, "gpus", "4")
    assert page.get_attribute("[data-key='column_w_shard']", "data-value") == "4096x1024"
    assert figure(page, "row_forward_bytes") == comm.all_reduce(mn, 4)
    start = time.monotonic()
    change(page, "m", "64")
    assert figure(page, "flops_per_gpu") == 2 * 64 * 4096 * 4096 / 4
    assert time.monotonic() - start < 10


def test_model_parallel_token_has_its_passes_colour(serve, page, tmp_path: Path):
    """The moving token is the forward's blue while the activation travels and the backward's orange while
    the gradient does, the colours of the timeline's bars (it was blue in the send-gradient phases)."""
    page.goto(f"{serve(tmp_path)}/model-parallel")
    wait_render(page)
    bars = page.evaluate(
        "Object.fromEntries(document.getElementById('mp-timeline').data.map(t => [t.name, t.marker.color]))"
    )
    want = {
        "forward": bars["forward"],
        "send-activation": bars["forward"],
        "backward": bars["backward"],
        "send-gradient": bars["backward"],
    }
    seen = {}
    for _ in range(14):  # 4 GPUs: 4 forwards, 3 sends, 4 backwards, 3 sends
        page.click("#step")
        phase = page.get_attribute("#mp-anim", "data-phase")
        kind = "-".join(phase.split("-")[:2]) if phase.startswith("send") else phase.split("-")[0]
        seen.setdefault(kind, set()).add(page.get_attribute("#mp-anim .mover circle", "fill"))
    assert seen == {k: {v} for k, v in want.items()}


def test_tensor_parallel_texts_neither_overlap_nor_leave_the_picture(serve, page, tmp_path: Path):
    """At 4 GPUs with M 2048, K 1024, N 4096 the row-parallel shard labels ("GPU 0: partial 2048×4096")
    are wider than their matrices: every text of the picture keeps its own box, inside the picture."""
    page.goto(f"{serve(tmp_path)}/tensor-parallel")
    wait_render(page)
    page.click("#pause")
    for name, value in (("m", "2048"), ("k", "1024"), ("n", "4096"), ("gpus", "4")):
        change(page, name, value)
    while page.get_attribute("#tp-anim", "data-phase") != "result":  # every stage drawn
        page.click("#step")
    svg = page.locator("#tp-anim").bounding_box()
    texts = page.eval_on_selector_all(
        "#tp-anim text",
        "els => els.map(e => { const r = e.getBoundingClientRect();"
        " return {t: e.textContent, x0: r.left, x1: r.right, y0: r.top, y1: r.bottom}; })",
    )
    assert "Y 2048×4096 on every GPU" in [t["t"] for t in texts]
    assert "GPU 3: partial 2048×4096" in [t["t"] for t in texts]
    for t in texts:
        assert svg["x"] <= t["x0"] and t["x1"] <= svg["x"] + svg["width"], t
    for i, a in enumerate(texts):
        for b in texts[i + 1 :]:
            apart = a["x1"] <= b["x0"] or b["x1"] <= a["x0"] or a["y1"] <= b["y0"] or b["y1"] <= a["y0"]
            assert apart, (a, b)
    screenshot(page, "tensor-parallel-4", tmp_path)
