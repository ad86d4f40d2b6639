"""The GPU memory page: at the seed defaults (6.7B model = llama-7b, batch 32, sequence 512, fp16, Adam) it
shows exactly ``lmforge estimate --json``'s breakdown for the same flags, its scaling points are the
planner's at those points, a changed control changes the figures, bad input is a one-line 400."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.plan.request import EstimateRequest, estimate_json
from lmforge.web.app import create_app
from tests.accuracy_matrix import MATRIX, PEAK_TEXT, ROW_TEXTS, install
from tests.conftest import estimate_cli, figure, renders, screenshot, wait_render

SEED = ["--train.micro_batch_size=32", "--data.seq_len=512", "--train.precision=fp16", "--optim.name=adam"]
ROWS = {  # the page's row key -> the field of estimate --json behind it
    "row.parameters": lambda e: e["states"]["params"] + e["buffers"],
    "row.gradients": lambda e: e["gradients_at_peak"],
    "row.master_weights": lambda e: e["states"]["master"],
    "row.optimizer_states": lambda e: e["states"]["optim"],
    "row.activations": lambda e: e["activations_at_peak"],
    "row.temporaries": lambda e: e["temporaries_at_peak"],
    "row.overhead": lambda e: e["overhead"],
    "total": lambda e: e["total"],
    "limit": lambda e: e["margin"] * e["memory_bytes"],
    "memory_bytes": lambda e: e["memory_bytes"],
}


# Tolerances: the page's figures are float64 arithmetic (JSON numbers) of the planner's formulas, the same on
# every CPU; pytest.approx (default 1e-6, or 1e-12) only absorbs the rounding of a sum taken in another order
# (~1e-16 relative).


def assert_breakdown(page, e: dict) -> None:
    for key, field in ROWS.items():
        assert figure(page, key) == field(e), key
    assert figure(page, "fits") == (1.0 if e["fits"] else 0.0)


def test_memory_page_shows_lmforge_estimate(tmp_path: Path, serve, page, capsys, cli_logging):
    url = serve(tmp_path)
    page.goto(f"{url}/memory")
    wait_render(page)
    form = {
        n: page.input_value(f"[name={n}]")
        for n in ("model", "micro_batch", "seq_len", "precision", "optimizer")
    }
    assert form == {
        "model": "llama-7b",
        "micro_batch": "32",
        "seq_len": "512",
        "precision": "fp16",
        "optimizer": "adam",
    }
    seed = estimate_cli(capsys, "--model", "llama-7b", *SEED)
    assert seed["n_params"] == 6_738_415_616
    assert_breakdown(page, seed)
    # rel=1e-12: a float64 sum of 7 rows against the total (the note at the top)
    assert sum(figure(page, k) for k in ROWS if k.startswith("row.")) == pytest.approx(
        seed["total"], rel=1e-12
    )
    # the seed's peak holds every activation: the note says so beside the activation table
    assert page.get_attribute("#memory-peak", "data-value") == seed["peak_phase"]
    # the row adds the forward's buffers alive at the peak (the loss's), as PyTorch's trackers count them
    forward_buffers = sum(seed["forward_buffers_alive"].values())
    assert (
        seed["activations_at_peak"]
        == seed["activations"] + forward_buffers
        == figure(page, "activation.at_peak")
    )
    assert "all of them are alive in this phase" in page.text_content("#memory-peak")
    screenshot(page, "memory", tmp_path)

    # scaling: each point is the planner's at that micro-batch / sequence length
    for prefix, key, values in (
        ("batch", "train.micro_batch_size", (1, 2, 4, 8, 16, 32, 64)),
        ("seq", "data.seq_len", (128, 256, 512, 1024, 2048, 4096)),
    ):
        for v in values:
            flags = [f for f in SEED if not f.startswith(f"--{key}=")] + [f"--{key}={v}"]
            e = estimate_json(EstimateRequest(model="llama-7b", overrides=tuple(flags)))["estimate"]
            assert figure(page, f"{prefix}.{v}.total") == e["total"], (prefix, v)
            assert figure(page, f"{prefix}.{v}.activations") == e["activations_at_peak"], (prefix, v)
    assert figure(page, "batch.64.total") > figure(page, "batch.32.total") > figure(page, "batch.8.total")

    n = renders(page)
    page.fill("[name=micro_batch]", "64")
    wait_render(page, after=n)
    assert figure(page, "total") == figure(page, "batch.64.total") > seed["total"]
    flags = [f for f in SEED if "micro_batch" not in f] + ["--train.micro_batch_size=64"]
    assert_breakdown(page, estimate_cli(capsys, "--model", "llama-7b", *flags))

    n = renders(page)  # 8 devices sharing the states (ZeRO-2), full checkpointing, bf16, AdamW
    page.fill("[name=gpus]", "8")
    page.select_option("[name=layout]", "zero2")
    page.select_option("[name=checkpointing]", "full")
    page.select_option("[name=precision]", "bf16")
    page.select_option("[name=optimizer]", "adamw")
    wait_render(page, after=n)
    page.wait_for_function(
        "document.getElementById('memory-command').textContent.includes('zero=2') "
        "&& document.getElementById('memory-command').textContent.includes('adamw')"
    )
    e = estimate_cli(
        capsys,
        "--model",
        "llama-7b",
        "--gpus",
        "8",
        "--train.micro_batch_size=64",
        "--data.seq_len=512",
        "--train.precision=bf16",
        "--optim.name=adamw",
        "--train.activation_checkpointing=full",
        "--parallel.dp_shard=8",
        "--parallel.zero=2",
    )
    assert e["layout"]["dp_shard"] == 8 and e["layout"]["zero"] == 2
    assert_breakdown(page, e)


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("micro_batch=0", "micro_batch"),
        ("seq_len=abc", "seq_len"),
        ("model=gpt5", "model"),
        ("optimizer=rmsprop", "optimizer"),
        ("gpu=a100-80gb&precision=fp8", "train.precision"),
        ("checkpointing=every:x", "checkpointing"),
    ],
)
def test_memory_api_bad_input_is_a_one_line_400(tmp_path: Path, query: str, name: str):
    r = create_app(tmp_path).test_client().get(f"/api/memory?{query}")
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert err.startswith(name) and "\n" not in err


def freed_activations_case() -> tuple[int, dict]:
    """A micro-batch of llama-7b (sequence 512, fp16, Adam, one device, no checkpointing) whose peak is
    a phase with no activation alive while the step saves GiB of them (the largest such micro-batch of
    1..8), and ``lmforge estimate --json``'s estimate for it."""
    found = None
    for micro_batch in range(1, 9):
        flags = [f for f in SEED if "micro_batch" not in f] + [f"--train.micro_batch_size={micro_batch}"]
        e = estimate_json(EstimateRequest(model="llama-7b", overrides=tuple(flags)))["estimate"]
        if e["activations_at_peak"] == 0 and e["activations"] > 0:
            found = (micro_batch, e)
    assert found, "no micro-batch of 1..8 peaks with its activations freed"
    return found


def test_memory_page_says_why_the_activations_row_is_0_and_its_accuracy(
    tmp_path: Path, serve, page, monkeypatch
):
    matrix = install(monkeypatch, tmp_path / "plan", None)  # no matrix: the accuracy is not measured
    micro_batch, e = freed_activations_case()
    assert e["activations"] > 8 * 2**30  # the activation table shows many GiB ...
    url = serve(tmp_path)
    page.goto(f"{url}/memory")
    wait_render(page)
    n = renders(page)
    page.fill("[name=micro_batch]", str(micro_batch))
    wait_render(page, after=n)
    page.wait_for_function(
        f"document.getElementById('memory-command').textContent.includes('={micro_batch} ')"
    )
    assert figure(page, "row.activations") == 0  # ... beside an activations row of 0
    assert figure(page, "activation.total") == e["activations"]
    assert figure(page, "activation.at_peak") == 0
    # rel=1e-12: a float64 sum of the parts against the total (the note at the top)
    assert sum(figure(page, f"activation.{k}") for k, v in e["activation_parts"].items() if v) == (
        pytest.approx(e["activations"], rel=1e-12)
    )
    note = page.text_content("#memory-peak")
    assert page.get_attribute("#memory-peak", "data-value") == e["peak_phase"]
    assert f'The peak is the phase "{e["peak_phase"]}"' in note
    assert f"gradients {e['gradients_at_peak'] / 2**30:.2f} GiB" in note
    assert f"{e['activations'] / 2**30:.2f} GiB of activations" in note
    assert "none are alive in this phase and the activations row is 0" in note
    assert "activations 0" not in note.split("Alive in it:")[1].split(".")[0]  # not listed as alive
    assert page.text_content("#memory-accuracy").startswith(
        "The planner's measured accuracy: accuracy not measured"
    )
    assert page.text_content("[data-key='total.accuracy']").startswith("accuracy not measured")
    screenshot(page, "memory-peak", tmp_path)

    matrix.write_text(json.dumps(MATRIX))  # the matrix appears: the next render shows its figures
    n = renders(page)
    page.select_option("[name=accounting]", "zero-paper")
    wait_render(page, after=n)
    page.wait_for_function("document.getElementById('memory-accuracy').dataset.measured === '1'")
    assert PEAK_TEXT in page.text_content("#memory-accuracy")
    assert page.text_content("[data-key='total.accuracy']") == PEAK_TEXT
    for row, text in ROW_TEXTS.items():
        assert page.text_content(f"[data-key='row.{row.replace(' ', '_')}.accuracy']") == text, row
    assert page.text_content("[data-key='row.overhead.accuracy']").startswith("not measured")


def set_controls(page, **values: str) -> None:
    """Fill the page's controls and wait for the render of the last change."""
    n = renders(page)
    for name, value in values.items():
        if name in ("model", "optimizer"):
            page.select_option(f"[name={name}]", value)
        else:
            page.fill(f"[name={name}]", value)
    wait_render(page, after=n)
    page.wait_for_function(
        f"document.getElementById('memory-command').textContent.includes('={values['micro_batch']} ')"
    )


def test_memory_page_shows_the_activations_own_peak_blank_shares_and_readable_numbers(
    tmp_path: Path, serve, page, capsys, cli_logging
):
    """llama-7b with SGD at micro-batch 1 peaks at the optimizer step, the activations freed: beside the
    activations row of 0, a row gives their own peak and says they are freed at this peak. Shares are of the
    total: the limit and the device memory, which are not parts of it, have none. 495,602 tokens/s reads as
    that, not 5e+5."""
    page.goto(f"{serve(tmp_path)}/memory")
    wait_render(page)
    set_controls(page, optimizer="sgd", micro_batch="1")
    e = estimate_cli(capsys, "--model", "llama-7b", *[f for f in SEED if "batch" not in f and "optim" not in f],
                     "--train.micro_batch_size=1", "--optim.name=sgd")  # fmt: skip
    assert e["peak_phase"] == "optimizer step" and e["activations_at_peak"] == 0 and e["activations"] > 2**33
    assert figure(page, "row.activations") == 0
    assert figure(page, "activations_own_peak") == e["activations"]
    note = page.text_content("[data-key='activations_own_peak.accuracy']")
    assert note.startswith('freed at the peak ("optimizer step")'), note
    shares = {k: page.get_attribute(f"[data-key='{k}.share']", "data-value") for k in ROWS}
    assert shares["limit"] == shares["memory_bytes"] == "" == page.text_content("[data-key='limit.share']")
    # rel=1e-12: 7 float64 quotients row / total summed (~7 x 1.1e-16; the note at the top)
    assert sum(float(v) for k, v in shares.items() if k.startswith("row.")) == pytest.approx(1, rel=1e-12)
    assert page.get_attribute("[data-key='activations_own_peak.share']", "data-value") == ""

    set_controls(page, model="gpt2-124m", optimizer="adam", micro_batch="8")
    g = estimate_cli(capsys, "--model", "gpt2-124m", *[f for f in SEED if "batch" not in f],
                     "--train.micro_batch_size=8")  # fmt: skip
    assert g["tokens_per_s"] >= 1e5
    verdict = page.text_content("#memory-verdict")
    assert f"{round(g['tokens_per_s']):,} tokens/s" in verdict and "e+" not in verdict, verdict
