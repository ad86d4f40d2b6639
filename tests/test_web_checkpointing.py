"""The gradient checkpointing page: at the seed defaults (12 layers, checkpoint every 3) each policy's
activation memory, compute factor and step time are ``lmforge estimate --json``'s for the same flags; the
figures measured by a real (tiny) run of ``benchmarks/activation_checkpointing.py --json`` under RUNS_DIR
are shown beside the formula; changing K changes the figures; bad input is a one-line 400."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.plan.activations import activation_bytes
from lmforge.plan.estimate import recompute_factor
from lmforge.web.app import create_app
from tests.accuracy_matrix import PEAK_TEXT, install
from tests.conftest import estimate_cli, figure, renders, screenshot, wait_render

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "activation_checkpointing.py"
TINY = ["--layers", "4", "--d-model", "32", "--heads", "2", "--vocab", "64", "--batch", "2", "--seq", "16"]
BASE = [
    "--model",
    "gpt2-124m",
    "--model.n_layers=12",
    "--train.micro_batch_size=8",
    "--data.seq_len=1024",
    "--train.precision=bf16",
]


@pytest.fixture
def runs_with_benchmark(tmp_path: Path, monkeypatch, capsys) -> Path:
    """A runs folder holding the JSON of a real tiny run of the benchmark, one folder down."""
    out = tmp_path / "runs" / "bench" / "activation_checkpointing.json"
    out.parent.mkdir(parents=True)
    argv = [
        str(BENCHMARK),
        *TINY,
        "--rounds",
        "1",
        "--steps",
        "1",
        "--policies",
        "none,full,every:3,selective",
    ]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine (conftest resets it)
    runpy.run_path(str(BENCHMARK), run_name="__main__")
    capsys.readouterr()
    return tmp_path / "runs"


def test_checkpointing_page_shows_estimate_and_benchmark(
    runs_with_benchmark: Path, serve, page, capsys, cli_logging, monkeypatch
):
    url = serve(runs_with_benchmark)
    page.goto(f"{url}/checkpointing")
    wait_render(page)
    assert page.input_value("[name=layers]") == "12" and page.input_value("[name=k]") == "3"
    for policy in ("none", "full", "every:3", "selective"):
        e = estimate_cli(capsys, *BASE, f"--train.activation_checkpointing={policy}")
        assert figure(page, f"{policy}.activations") == e["activations"], policy
        assert figure(page, f"{policy}.recompute_peak") == e["activation_parts"]["recompute"], policy
        assert figure(page, f"{policy}.forward_casts") == e["activation_parts"]["forward_casts"], policy
        assert figure(page, f"{policy}.total") == e["total"], policy
        assert figure(page, f"{policy}.recompute") == e["recompute"] == recompute_factor(policy), policy
        assert figure(page, f"{policy}.step_s") == e["step_s"], policy
    assert (
        figure(page, "full.activations")
        < figure(page, "every:3.activations")
        < figure(page, "none.activations")
    )
    assert figure(page, "every:3.recompute") == 1 + 1 / 9 and figure(page, "full.recompute") == 4 / 3

    # the benchmark's measured figures beside the formula for its shape
    data = json.loads((runs_with_benchmark / "bench" / "activation_checkpointing.json").read_text())
    s = data["shape"]
    cfg = ModelConfig(
        arch="llama", n_layers=s["layers"], d_model=s["d_model"], n_heads=s["heads"], doc_mask=False
    )
    assert [r["policy"] for r in data["rows"]] == ["none", "full", "every:3", "selective"]
    for r in data["rows"]:
        p = r["policy"]
        assert figure(page, f"measured.0.{p}.saved_bytes") == r["saved_bytes"]
        assert figure(page, f"measured.0.{p}.flops_ratio") == r["flops_ratio"]
        assert figure(page, f"measured.0.{p}.time_ratio") == r["time_ratio"]
        formula = activation_bytes(
            cfg, s["vocab"], s["seq"], s["batch"], p, 4, "flash", 1024, device_type="cpu", loss="fused"
        )
        assert figure(page, f"formula.0.{p}.saved_bytes") == formula.total
        # bytes, not rounding (the same on every CPU): the formula against the saved bytes the benchmark
        # measured above; tests/test_activation_estimate.py holds the formula to the exact byte, so 2% is
        # room for what the benchmark's own step adds, not a machine's figure
        assert formula.total == pytest.approx(r["saved_bytes"], rel=0.02), p
        assert figure(page, f"formula.0.{p}.compute_ratio") == recompute_factor(p)
    assert page.locator("#checkpointing-measured h3").inner_text() == "bench/activation_checkpointing.json"
    screenshot(page, "checkpointing", tmp_path=runs_with_benchmark.parent)

    install(monkeypatch, runs_with_benchmark.parent / "plan")  # a matrix with the test's figures
    n = renders(page)
    page.fill("[name=k]", "2")
    wait_render(page, after=n)
    page.wait_for_selector("[data-key='every:2.activations']")
    e = estimate_cli(capsys, *BASE, "--train.activation_checkpointing=every:2")
    assert (
        figure(page, "every:2.activations")
        == e["activations"]
        < estimate_cli(capsys, *BASE, "--train.activation_checkpointing=every:3")["activations"]
    )
    assert figure(page, "every:2.recompute") == 1 + 1 / 6
    assert page.text_content("#checkpointing-accuracy") == (
        f"Device total, the planner's measured accuracy: {PEAK_TEXT} (docs/memory-accuracy.md)."
    )


def test_checkpointing_without_benchmark_says_how_to_measure(tmp_path: Path):
    r = create_app(tmp_path).test_client().get("/api/checkpointing?layers=6&k=2")
    assert r.status_code == 200
    body = r.get_json()
    assert (
        body["measured"] == []
        and "benchmarks/activation_checkpointing.py --json" in body["benchmark_command"]
    )
    assert [p["policy"] for p in body["policies"]] == ["none", "full", "every:2", "selective"]


def test_checkpointing_skips_a_link_out_and_reports_a_foreign_json(tmp_path: Path):
    runs = tmp_path / "runs"
    runs.mkdir()
    (tmp_path / "activation_checkpointing_out.json").write_text("{}")
    (runs / "activation_checkpointing_link.json").symlink_to(tmp_path / "activation_checkpointing_out.json")
    (runs / "activation_checkpointing_bad.json").write_text('{"rows": []}')
    body = create_app(runs).test_client().get("/api/checkpointing").get_json()
    assert [m["file"] for m in body["measured"]] == ["activation_checkpointing_bad.json"]
    assert "not a benchmarks/activation_checkpointing.py JSON" in body["measured"][0]["error"]


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("k=13", "k"),
        ("layers=0", "layers"),
        ("micro_batch=-1", "micro_batch"),
        ("precision=int4", "precision"),
    ],
)
def test_checkpointing_api_bad_input_is_a_one_line_400(tmp_path: Path, query: str, name: str):
    r = create_app(tmp_path).test_client().get(f"/api/checkpointing?{query}")
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert err.startswith(name) and "\n" not in err
