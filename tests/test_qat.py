"""Quantization-aware training (``model/qat.py``) and ``lmforge export --quantize``
(``evaluate/quantized.py``): the fake quantization against a hand computation, a resume, and the
exported integer model against the fake-quantized one, loaded in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lmforge.cli import main
from lmforge.evaluate.run_loading import load_run
from lmforge.model.qat import QATLinear, apply_qat, set_fake_quant
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import cli_args


def hand_weight(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-group symmetric quantize-dequantize in plain torch: s = absmax / ((2^b - 1) / 2) per row and
    group, q = clamp(round(w * (1 / s)), -2^(b-1), 2^(b-1) - 1), w~ = q s."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    s = (g.abs().amax(-1, keepdim=True) / ((2**bits - 1) / 2)).clamp(min=torch.finfo(w.dtype).tiny)
    q = torch.clamp(torch.round(g * (1.0 / s)), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return (q * s).reshape(rows, cols)


def hand_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token asymmetric int8 quantize-dequantize: s = (max(x, 0) - min(x, 0)) / 255, zero point
    z = -128 - round(min / s), x~ = (clamp(round(x * (1 / s)) + z, -128, 127) - z) s."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 255).clamp(min=torch.finfo(x.dtype).tiny)
    z = torch.clamp(-128 - torch.round(lo / s), -128, 127)
    return (torch.clamp(torch.round(x * (1.0 / s)) + z, -128, 127) - z) * s


@pytest.mark.parametrize(
    "scheme, bits, acts", [("int8da-int4w", 4, True), ("int4w", 4, False), ("int8w", 8, False)]
)
def test_fake_quantized_linear_equals_hand_quantize_dequantize(scheme, bits, acts):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 24, bias=True))
    x = torch.randn(3, 5, 64, requires_grad=True)
    w = model[0].weight.detach().clone()
    assert apply_qat(model, scheme, 16) == ["0"]
    layer = model[0]
    assert isinstance(layer, QATLinear) and layer.weight is model[0].weight  # same parameter, same name
    y = layer(x)
    xq = hand_activation(x.detach()) if acts else x.detach()
    expected = xq @ hand_weight(w, bits, 16).T + layer.bias.detach()
    # 1e-6: float32 matmuls of 64 products of the same rounded operands (measured max 4.8e-7 on CPU)
    assert torch.allclose(y, expected, rtol=0, atol=1e-6)
    # the rounding actually bites (int4: a visible error) and switching off gives the plain layer
    assert (y - (x @ w.T + layer.bias)).abs().max() > 1e-3
    set_fake_quant(model, False)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    # straight-through estimator: the weight's gradient is that of the rounded weight, x~^T dy, where the
    # rounded code lies on the grid, and 0 where clamp cut it (a group's positive extreme, on its tie)
    set_fake_quant(model, True)
    layer.weight.grad = None
    layer(x).sum().backward()
    # 1e-5: sums of 15 float32 products of size ~3 (measured 1.9e-6)
    groups = w.reshape(24, 4, 16)
    s = groups.abs().amax(-1, keepdim=True) / ((2**bits - 1) / 2)
    codes = torch.round(groups * (1.0 / s)).reshape(24, 64)
    inside = (codes >= -(2 ** (bits - 1))) & (codes <= 2 ** (bits - 1) - 1)
    assert not inside.all()
    expected_grad = (torch.ones(15, 24).T @ xq.reshape(15, 64)) * inside
    # bound: the 1e-5 comment above (sums of 15 FP32 products of size ~3, measured 1.9e-6)
    assert torch.allclose(layer.weight.grad, expected_grad, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def qat_runs(corpus_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """Three 6-step runs of the tiny model: QAT from step 2 straight (a), the same stopped after step 3
    and resumed (b), and without QAT (c)."""
    from lmforge.recipe import load_config
    from tests.conftest import tiny_overrides

    root = tmp_path_factory.mktemp("qat")
    over = {
        **tiny_overrides(corpus_dir, root / "data"),
        "train.steps": 6,
        "train.checkpoint_interval": 3,
        "train.eval_interval": 0,
        "train.sample_tokens": 0,
        "train.log_interval": 1,
        "schedule.warmup": 1,
    }
    qat = {**over, "qat.enabled": True, "qat.group_size": 16, "qat.start_step": 2}
    cfg = load_config(None, qat)
    train(cfg, root / "a", progress_bar=False)
    train(cfg, root / "b", progress_bar=False, callbacks=[StopAfter(3)])
    train(cfg, root / "b", resume=True, progress_bar=False)
    train(load_config(None, over), root / "c", progress_bar=False)
    return root / "a", root / "b", root / "c"


def _losses(run: Path) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


@pytest.mark.slow
def test_qat_resume_equals_uninterrupted_and_starts_at_its_step(qat_runs):
    a, b, c = qat_runs
    last_a, last_b = (load_checkpoint(latest_checkpoint(r)) for r in (a, b))
    assert set(last_a["model"]) == set(load_checkpoint(latest_checkpoint(c))["model"])  # no new tensors
    for key, value in last_a["model"].items():  # fp32, CPU, deterministic: bitwise
        assert torch.equal(value, last_b["model"][key]), key
    assert _losses(b)[-3:] == _losses(a)[-3:]
    # steps 0 and 1 train in full precision (the same losses as without QAT), fake quantization from 2 on
    qa, plain = _losses(a), _losses(c)
    assert qa[:2] == plain[:2]
    assert all(x != y for x, y in zip(qa[2:], plain[2:], strict=True))


def _fake_quant_logits(run: Path, ids: torch.Tensor) -> torch.Tensor:
    _, _, model, _ = load_run(run, torch.device("cpu"))
    apply_qat(model, "int8da-int4w", 16)
    with torch.no_grad():
        return model(ids)


LOAD_SCRIPT = """
import sys, torch
from lmforge.evaluate.run_loading import load_run
_, _, model, _ = load_run(sys.argv[1], torch.device("cpu"))
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])), sys.argv[3])
"""


@pytest.mark.slow
def test_exported_int8da_int4w_model_loads_in_a_fresh_process_with_the_fake_quantized_logits(
    qat_runs, tmp_path
):
    a = qat_runs[0]
    with pytest.raises(SystemExit) as out:
        main(["export", str(a), "--quantize", "int8da-int4w", "--out", str(tmp_path / "q")])
    assert out.value.code == 0
    info = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert info["scheme"] == "int8da-int4w" and info["group_size"] == 16 and len(info["layers"]) == 2 * 7
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_SCRIPT,
            str(tmp_path / "q"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "y.pt"),
        ],
        check=True,
        capture_output=True,
    )
    exported = torch.load(tmp_path / "y.pt")
    fake = _fake_quant_logits(a, ids)
    _, _, plain, _ = load_run(a, torch.device("cpu"))
    with torch.no_grad():
        full = plain(ids)
    gap = (exported - fake).abs().max().item()
    # 1e-5: measured 0.0 on CPU (torchao's CPU path dequantizes the same codes and scales to the same
    # floats before one float matmul); the bound leaves room for a kernel that sums in another order.
    # The fake-quantized model itself is 1e-2 or more away from the full-precision one (measured 0.12)
    assert gap < 1e-5, gap
    assert (full - fake).abs().max().item() > 1e-2
    int8_weight = dict(torch.load(tmp_path / "q" / "model.pt", weights_only=True))[
        "blocks.0.attn.q_proj.weight"
    ]
    assert int8_weight.qdata.dtype == torch.int8 and int8_weight.qdata.abs().max() <= 8


@pytest.mark.slow
def test_bad_scheme_group_size_and_clashes_are_refused_in_one_line(qat_runs, corpus_dir, tmp_path, capsys):
    a = qat_runs[0]
    for args, words in (
        (
            ["export", str(a), "--quantize", "int3w"],
            ["--quantize", "int8da-int4w, int4w, int8da-int8w, int8w"],
        ),
        (["export", str(a), "--quantize", "int4w", "--group-size", "24"], ["--group-size", "24", "32"]),
    ):
        with pytest.raises(SystemExit) as out:
            main(args)
        assert out.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), err
    from tests.conftest import tiny_overrides

    over = cli_args(tiny_overrides(corpus_dir, tmp_path / "data"))
    for flags, word in ((["--qat.group_size=24"], "qat.group_size"), (["--lora.rank=4"], "lora.rank")):
        with pytest.raises(SystemExit) as out:
            main(["train", "--run-dir", str(tmp_path / "x"), *over, "--qat.enabled=true", *flags])
        assert out.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and word in err[0], err
        assert not (tmp_path / "x").exists()


def test_moe_router_is_fake_quantized_as_the_export_quantizes_it(moe_run):
    """Every layer QAT lists runs its fake quantizer, an MoE router included (it is called through its
    module): the fake-quantized MoE model's logits equal those of the model quantized as ``export
    --quantize`` does (torchao's post-training config), as on a dense model. With the router's product
    computed beside its module the two differed by 0.81."""
    from lmforge.evaluate.quantized import quantize_model

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    _, _, fake, _ = load_run(moe_run, torch.device("cpu"))
    names = apply_qat(fake, "int8da-int4w", 16)
    assert "blocks.0.mlp.router" in names and "blocks.1.mlp.router" in names
    calls = []
    fake.blocks["0"].mlp.router.weight_fake_quant.register_forward_hook(lambda *_: calls.append(1))
    _, _, exported, _ = load_run(moe_run, torch.device("cpu"))
    assert quantize_model(exported, "int8da-int4w", 16) == sorted(names)
    with torch.no_grad():
        gap = (fake(ids) - exported(ids)).abs().max().item()
    assert calls
    # the bound of test_exported_int8da_int4w_model_loads_...: measured 0.0 on the dense model (the same codes
    # and scales dequantized to the same floats before one matmul); 1e-5 leaves room for another summation order
    assert gap < 1e-5, gap
