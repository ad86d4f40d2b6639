from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lmforge.cli import main
from lmforge.config import Config, ModelConfig, OptimConfig
from lmforge.data.loader import Batch
from lmforge.errors import ConfigError, UserError
from lmforge.model.loss import NextTokenLoss
from lmforge.optim.build import build_optimizer, param_groups
from lmforge.optim.clip import Clipper
from lmforge.optim.schedules import lr_multiplier
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config
from lmforge.train.build import accumulation_steps
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from lmforge.train.launch import train
from lmforge.train.modules import LanguageModelModule
from lmforge.train.step import train_step
from tests.conftest import cli_args, model_of, tiny_overrides

FP32 = PrecisionPolicy("fp32", torch.device("cpu"))


def _grads_after(batches, seed=0):
    torch.manual_seed(seed)
    m = model_of(ModelConfig(n_layers=2, d_model=32, n_heads=4), 101, 16)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    # lr 0 and no clipping: gradients are what train_step accumulated before its optimizer step
    grads = {}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
        for n, p in m.named_parameters()
    ]
    n_calls = len(batches)
    loss = train_step(
        LanguageModelModule.of(NextTokenLoss(m, 16)), opt, batches, 0.0, Clipper("norm", 0.0), FP32
    ).loss
    for h in hooks:
        h.remove()
    return loss, grads, n_calls


def test_gradient_accumulation_matches_one_big_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 101, (8, 16), generator=g)
    y = torch.randint(0, 101, (8, 16), generator=g)
    y[1, :5] = -100  # uneven target counts per micro-batch: normalisation is by the step's total
    doc = torch.zeros(8, 16, dtype=torch.long)
    big = [Batch(x, y, doc)]
    small = [Batch(x[i : i + 2], y[i : i + 2], doc[i : i + 2]) for i in range(0, 8, 2)]
    loss_big, g_big, _ = _grads_after(big)
    loss_small, g_small, _ = _grads_after(small)
    # FP32: the same token losses summed per micro-batch or at once, gradients accumulated over 4 backward
    # passes or made in one. Measured bitwise equal (2-core AMD EPYC with AVX-512-BF16, no AMX); the bounds
    # are FP32 room for a CPU whose kernels block the batch otherwise: sums of <= 128 terms round at up to
    # 128 u = 7.6e-6 of their magnitude, ~1e-6 for a random-walk sum (u = 2^-24)
    torch.testing.assert_close(loss_small, loss_big, rtol=1e-6, atol=0)
    assert g_big.keys() == g_small.keys() and len(g_big) > 10
    for name, grad in g_big.items():
        # relative error of each gradient tensor (summation order differs, so not elementwise-bitwise)
        rel = ((g_small[name] - grad).norm() / grad.norm()).item()
        # bound: the FP32 room in the comment above the loss's (measured bitwise equal)
        assert rel < 1e-6, (name, rel)


def test_accumulation_steps_and_validation():
    cfg = load_config(None, {"train.micro_batch_size": 2, "data.seq_len": 16, "train.tokens_per_step": 128})
    assert accumulation_steps(cfg) == 4
    bad = load_config(None, {"train.micro_batch_size": 2, "data.seq_len": 16, "train.tokens_per_step": 100})
    with pytest.raises(UserError, match=r"train\.tokens_per_step: 100 is not a multiple"):
        accumulation_steps(bad)


def _wd_and_mult(model, cfg):
    out = {}
    for g in param_groups(model, cfg):
        for p in g["params"]:
            out[id(p)] = (g["weight_decay"], g["lr_mult"])
    return out


def test_no_decay_for_biases_norms_embeddings():
    m = model_of(ModelConfig(arch="gpt2", n_layers=1, d_model=32, n_heads=4, tie_embeddings=False), 50, 8)
    wd = _wd_and_mult(m, OptimConfig())
    assert len(wd) == len(list(m.parameters()))
    assert wd[id(m.blocks[0].attn.q_proj.weight)][0] == 0.1 and wd[id(m.lm_head.weight)][0] == 0.1
    for p in [m.embed.weight, m.pos_embed.weight, m.blocks[0].attn.q_proj.bias, m.norm.weight]:
        assert wd[id(p)][0] == 0.0
    assert _wd_and_mult(m, OptimConfig(decay_embeddings=True))[id(m.embed.weight)][0] == 0.1
    opt = build_optimizer(m, OptimConfig(), torch.device("cpu"))
    assert opt.defaults["betas"] == (0.9, 0.95) and isinstance(opt, torch.optim.AdamW)


def test_per_kind_settings_and_layerwise_decay():
    m = model_of(ModelConfig(n_layers=3, d_model=32, n_heads=4, tie_embeddings=False), 50, 8)
    cfg = OptimConfig(group_lr_mult={"embedding": 0.5}, group_weight_decay={"norm": 0.01}, layer_lr_decay=0.5)
    got = _wd_and_mult(m, cfg)
    assert got[id(m.embed.weight)] == (0.0, 0.5 * 0.5**4)  # depth 0 of L + 1 = 4
    assert got[id(m.blocks[0].attn.q_proj.weight)] == (0.1, 0.5**3)
    assert got[id(m.blocks[2].mlp.up_proj.weight)] == (0.1, 0.5**1)
    assert got[id(m.blocks[1].attn_norm.weight)] == (0.01, 0.5**2)
    assert got[id(m.lm_head.weight)] == (0.1, 1.0) and got[id(m.norm.weight)] == (0.01, 1.0)
    opt = build_optimizer(m, cfg, torch.device("cpu"))
    x = torch.randint(0, 50, (2, 8))
    train_step(
        LanguageModelModule.of(NextTokenLoss(m)),
        opt,
        [Batch(x, x, torch.zeros_like(x))],
        0.01,
        Clipper("norm", 1.0),
        FP32,
    )
    for g in opt.param_groups:  # float64 products on Python numbers: rounding only
        assert g["lr"] == pytest.approx(0.01 * g["lr_mult"])
    with pytest.raises(ConfigError, match="unknown kind 'heads'"):
        load_config(None, {"optim.group_lr_mult": {"heads": 2.0}})


def test_warmup_cosine_schedule():  # float64 formulas: pytest.approx's default is rounding room
    cfg = Config().schedule.model_copy(update={"warmup": 10, "min_lr_ratio": 0.1})
    assert lr_multiplier(cfg, 0, 110) == pytest.approx(0.1)
    assert lr_multiplier(cfg, 9, 110) == pytest.approx(1.0)
    assert lr_multiplier(cfg, 60, 110) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_multiplier(cfg, 110, 110) == pytest.approx(0.1)
    lin = cfg.model_copy(update={"name": "linear"})
    assert lr_multiplier(lin, 60, 110) == pytest.approx(0.55)


def _params(run_dir):
    state = load_checkpoint(latest_checkpoint(run_dir))
    return state["model"], state["optimizer"]


def test_resume_is_bitwise_exact(tiny_config, tmp_path):
    straight = train(tiny_config, tmp_path / "straight", progress_bar=False)
    train(
        tiny_config, tmp_path / "resumed", progress_bar=False, callbacks=[StopAfter(10)]
    )  # as if killed after step 10
    resumed = train(tiny_config, tmp_path / "resumed", resume=True, progress_bar=False)
    a, oa = _params(tmp_path / "straight")
    b, ob = _params(tmp_path / "resumed")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    moments = [k for k in oa if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert moments and all(torch.equal(oa[k], ob[k]) for k in moments)
    assert resumed["val_loss"] == straight["val_loss"]
    steps = [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    want = [json.loads(x)["step"] for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert steps == want  # each step logged once across the interruption
    assert resumed["tokens_seen"] == straight["tokens_seen"] == 20 * 4 * 32


def test_run_outputs(tiny_config, tmp_path):
    run = tmp_path / "run"
    summary = train(tiny_config, run, progress_bar=False)
    for name in ["config.toml", "metrics.jsonl", "summary.json", "tokenizer.json"]:
        assert (run / name).is_file(), name
    assert list((run / "tensorboard").iterdir())
    assert load_config(run / "config.toml") == tiny_config
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "loss" in x]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "eta_s"} <= set(train_lines[0])
    assert [x["step"] for x in lines if "val_loss" in x] == [10, 20]
    on_disk = json.loads((run / "summary.json").read_text())
    for key in ["val_loss", "unigram_loss", "tokens_seen", "wall_time_s"]:
        assert key in on_disk
    assert summary["val_loss"] < summary["unigram_loss"] * 1.2  # 20 tiny steps: near unigram level
    assert train_lines[-1]["loss"] < train_lines[0]["loss"]
    assert [p.name for p in list_checkpoints(run)] == ["step_00000010", "step_00000020"]
    with pytest.raises(UserError, match="already holds checkpoints"):
        train(tiny_config, run, progress_bar=False)


def test_a_run_folder_inside_another_run_is_refused(tiny_config, corpus_dir, tmp_path, capsys, cli_logging):
    run = tmp_path / "run"
    train(tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"steps": 2})}), run)
    capsys.readouterr()  # the run's own output (through whatever handler an earlier test left) is not the CLI's
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for inside in (run / "checkpoints", run / "checkpoints" / "step_00000002" / "x", run / "new"):
        with pytest.raises(SystemExit) as done:
            main(
                ["train", "--run-dir", str(inside), *cli_args(tiny_overrides(corpus_dir, tmp_path / "data"))]
            )
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and len(err) == 1, err
        assert err[0] == (
            f"lmforge train: error: --run-dir: {inside} lies inside the run folder {run.resolve()}; choose a "
            "folder outside any run (e.g. runs/NAME)"
        )
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


def test_interrupted_checkpoint_is_ignored(tiny_config, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_config
    train(cfg, run, progress_bar=False, callbacks=[StopAfter(10)])
    partial = run / "checkpoints" / "step_00000015.tmp"
    partial.mkdir()
    (partial / "trainer.pt").write_bytes(b"half a file")
    assert latest_checkpoint(run).name == "step_00000010"
    train(cfg, run, resume=True, progress_bar=False)
    assert not partial.exists() and latest_checkpoint(run).name == "step_00000020"


def test_cli_train_eval_generate(corpus_dir, tmp_path):
    args = cli_args(tiny_overrides(corpus_dir, tmp_path / "data"))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "lmforge"]
    r = subprocess.run(
        [*cmd, "train", "--run-dir", str(run), *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "val_loss" in r.stdout and "sample:" in r.stdout
    r = subprocess.run([*cmd, "eval", str(run)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the same checkpoint scored by eval and by the run's end (the same FP32 windows): measured equal
    # (pytest.approx's default rel 1e-6 is ~8 FP32 eps of 1.2e-7 of room)
    assert out["step"] == 20 and out["val_loss"] == pytest.approx(
        json.loads((run / "summary.json").read_text())["val_loss"]
    )
    r = subprocess.run(
        [*cmd, "generate", str(run), "--prompt", "def ", "--max-new-tokens", "10", "--top-k", "5"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr
    r = subprocess.run([*cmd, "eval", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "not an lmforge run folder" in r.stderr
