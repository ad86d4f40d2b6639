"""Gradient noise, gradient centralization, weight decay by depth and cautious weight decay: each against a
hand computation, in the step where it belongs, and through an exact resume (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lmforge.config import ModelConfig, OptimConfig
from lmforge.errors import ConfigError
from lmforge.optim.build import build_optimizer, depth_decay_mult, param_groups
from lmforge.optim.clip import Clipper
from lmforge.optim.grad_transforms import GradTransforms, centralize_, noise_std
from lmforge.recipe import load_config
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import model_of
from tests.torchrun import torchrun, worker

CPU = torch.device("cpu")


def _param(values) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=torch.float32))


# -- gradient noise ------------------------------------------------------------------------------------


def test_noise_std_is_the_papers_annealed_variance():
    """sigma_t = sqrt(eta / (1 + t)^gamma), values worked out by hand (calculator)."""
    # rel=1e-12: sqrt(0.01) = 0.1 in float64 (rounding only); rel=1e-8: the calculator's 9 digits
    # (half a unit of the last digit: <= 7.3e-9 relative)
    assert noise_std(0.01, 0.55, 0) == pytest.approx(0.1, rel=1e-12)
    assert noise_std(0.3, 0.55, 9) == pytest.approx(0.290777385, rel=1e-8)  # sqrt(0.3 / 10^0.55)
    assert noise_std(0.01, 0.55, 3) == pytest.approx(0.068302013, rel=1e-8)  # sqrt(0.01 / 4^0.55)


def test_noise_has_the_scheduled_spread_and_is_a_function_of_seed_step_and_name():
    """Zero gradients + noise: mean ~0 and std ~sigma_t at t = 0 and t = 3 (400k draws: the std's
    relative error is ~0.1%); the same (seed, step, name) draws the same values, another name others."""
    a, b = _param([0.0] * 400_000), _param([0.0] * 400_000)
    tr = GradTransforms({id(a): "a", id(b): "b"}, eta=0.01, gamma=0.55, seed=7)
    for t, sigma in [(0, 0.1), (3, 0.068302013)]:
        a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
        tr.load_state_dict({"t": t})
        tr.apply([[a, b]])
        assert tr.t == t + 1
        assert abs(a.grad.mean().item()) < 6 * sigma / 400_000**0.5  # six standard errors
        # rel=0.01: the std of 400k draws has standard error 1/sqrt(2 x 400k) = 0.11%; 1% is ~9 of them
        assert a.grad.std().item() == pytest.approx(sigma, rel=0.01)
        assert not torch.equal(a.grad, b.grad)
    again = GradTransforms({id(a): "a"}, eta=0.01, gamma=0.55, seed=7)
    again.load_state_dict({"t": 3})
    first = a.grad.clone()
    a.grad = torch.zeros_like(a)
    again.apply([[a]])
    assert torch.equal(a.grad, first)


def test_noise_is_added_after_clipping():
    """With a threshold of 1e-3 and noise of std 0.1 over 1000 values (norm ~3.2), the gradient the
    optimizer sees has norm ~3.2: clipping came first and did not shrink the noise."""
    p = _param([1.0] * 1000)
    p.grad = torch.full_like(p, 5.0)
    clipper = Clipper("norm", max_norm=1e-3)
    norm = clipper.measure([[p]])
    clipper.clip([[p]], norm)
    GradTransforms({id(p): "p"}, eta=0.01, seed=0).apply([[p]])
    # FP32 norm of 1000 fives (the sum of squares, 25000, is exact): one sqrt rounding, under approx's 1e-6
    assert norm.item() == pytest.approx(5.0 * 1000**0.5)
    # the noise's norm: sqrt of a chi-square of 1000 draws, relative spread 1/sqrt(2000) = 2.2% (the
    # clipped 1e-3 adds nothing visible); 10% is ~4.5 of them
    assert p.grad.norm().item() == pytest.approx(0.1 * 1000**0.5, rel=0.1)


# -- gradient centralization ---------------------------------------------------------------------------


def test_centralize_subtracts_each_rows_mean_over_its_inputs():
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, 8.0]])  # nn.Linear's [out, in]: rows are output units
    assert torch.equal(centralize_(g), torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0]]))


def test_centralization_takes_2d_weights_but_not_embeddings_norms_biases():
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, tie_embeddings=True)
    model = model_of(cfg, 64, 16)
    tr = GradTransforms.for_model(model, True, 0.0, 0.55, 0)
    names = {n for n, p in model.named_parameters() if id(p) in tr.centralized}
    assert "blocks.0.attn.q_proj.weight" in names and "blocks.1.mlp.down_proj.weight" in names
    assert all(model.get_parameter(n).ndim == 2 and "embed" not in n and "norm" not in n for n in names)
    assert len(names) == sum(1 for n, p in model.named_parameters() if p.ndim == 2) - 1  # all but embed


def _adamw_gc_reference(p0, grads, lr, wd, betas=(0.9, 0.95), eps=1e-8):
    """AdamW with gradient centralization written out as the paper's Adam/AdamW variant does it: the
    gradient centralized first thing in the step, then the moments, bias correction, decoupled decay."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for t, g in enumerate(grads, 1):
        g = g - g.mean(dim=1, keepdim=True)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p * (1 - lr * wd) - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p


def test_centralization_before_adamw_is_adamw_with_centralization_inside():
    torch.manual_seed(0)
    model = nn.Linear(6, 4, bias=False)
    p0 = model.weight.detach().clone()
    grads = [torch.randn(4, 6) for _ in range(3)]
    opt = build_optimizer(model, OptimConfig(lr=0.01, weight_decay=0.1, fused=False), CPU)
    tr = GradTransforms({id(model.weight): "weight"}, frozenset({id(model.weight)}))
    for g in grads:
        model.weight.grad = g.clone()
        tr.apply([[model.weight]])
        opt.step()
    want = _adamw_gc_reference(p0, grads, 0.01, 0.1)
    # FP32 AdamW, 3 steps, against the same formula in FP32 in another order: a few ulps of |p| <= 0.41
    # (ulp 3e-8) per step; the bound, 1e-7 + 1e-6 |p|, is ~17 such ulps at 0.41, more below
    torch.testing.assert_close(model.weight.detach(), want, rtol=1e-6, atol=1e-7)


# -- weight decay by depth -----------------------------------------------------------------------------


def test_depth_decay_multiplier_is_linear_from_first_to_last():
    assert [depth_decay_mult(0.0, 1.5, d, 2) for d in range(4)] == [0.0, 0.5, 1.0, 1.5]


def test_depth_decay_sets_each_blocks_group_decay():
    model = model_of(ModelConfig(n_layers=2, d_model=32, n_heads=4, tie_embeddings=False), 64, 16)
    cfg = OptimConfig(weight_decay=0.1, decay_embeddings=True, depth_decay={"first": 0.0, "last": 1.5})
    decay = {g["name"]: g["weight_decay"] for g in param_groups(model, cfg)}
    # L = 2: depth 0 embeddings x0, block 0 x0.5, block 1 x1.0, head x1.5; norms and biases none
    assert decay["embedding@0"] == 0.0
    # default approx: float64 products like 0.1 x 0.5 (rounding only)
    assert decay["matrix@1"] == pytest.approx(0.05) and decay["matrix@2"] == pytest.approx(0.1)
    assert decay["matrix@3"] == pytest.approx(0.15)
    assert decay["norm@1"] == 0.0
    assert {g["name"] for g in param_groups(model, OptimConfig())} == {"embedding", "matrix", "norm"}


# -- cautious weight decay -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_cautious_decay_only_where_update_and_parameter_share_a_sign(name):
    """One first step on x = [1, -1, 2, -2] with g = [1, 1, -1, -1]: AdamW's first update and Lion's are
    both sign(g) = [1, 1, -1, -1], so u * x = [1, -1, -2, 2] and only coordinates 0 and 3 decay.
    lr 0.1, wd 0.5: x - 0.1 u - 0.05 [1, 0, 0, 1] x = [0.85, -1.1, 2.1, -1.8]."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0, 2.0, -2.0]]))
    cfg = OptimConfig(name=name, lr=0.1, weight_decay=0.5, cautious_weight_decay=True, fused=False)
    opt = build_optimizer(model, cfg, CPU)
    assert opt.param_groups[0]["weight_decay"] == 0.0 and opt.param_groups[0]["cautious_weight_decay"] == 0.5
    model.weight.grad = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    opt.step()
    want = torch.tensor([[0.85, -1.1, 2.1, -1.8]])
    # FP32, one step on |x| <= 2.1 against decimal hand values: FP32's ulp at 2 is 2.4e-7, a few roundings;
    # 1e-6 is ~4 ulps
    torch.testing.assert_close(model.weight.detach(), want, rtol=0, atol=1e-6)


def test_cautious_decay_is_refused_for_l2_decay_optimizers():
    with pytest.raises(ConfigError, match=r"optim\.cautious_weight_decay: adam adds decay to the gradient"):
        load_config(None, {"optim.name": "adam", "optim.cautious_weight_decay": True})


# -- through a run, and its resume ---------------------------------------------------------------------


def test_techniques_resume_exactly(tiny_config, tmp_path):
    """All four on: 8 steps straight vs 4 + resume + 4 give bitwise equal parameters (the noise continues
    at its step count), and they differ from a run without them."""
    cfg = tiny_config.model_copy(deep=True)
    cfg.train.steps, cfg.train.checkpoint_interval = 8, 4
    cfg.train.eval_interval, cfg.train.sample_tokens = 0, 0
    plain = cfg.model_copy(deep=True)
    o = cfg.optim
    o.grad_noise.eta, o.grad_centralization, o.cautious_weight_decay = 0.01, True, True
    o.depth_decay.first, o.depth_decay.last = 0.5, 2.0
    train(cfg, tmp_path / "a", progress_bar=False)
    train(cfg, tmp_path / "b", progress_bar=False, callbacks=[StopAfter(4)])
    train(cfg, tmp_path / "b", resume=True, progress_bar=False)
    train(plain, tmp_path / "c", progress_bar=False)
    a, b, c = (load_checkpoint(latest_checkpoint(tmp_path / r)) for r in "abc")
    assert a["grad_transforms"] == b["grad_transforms"] == {"t": 8}
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    assert not torch.equal(
        a["model"]["blocks.0.attn.q_proj.weight"], c["model"]["blocks.0.attn.q_proj.weight"]
    )


@pytest.mark.distributed
def test_techniques_on_sharded_gradients_match_one_process():
    """2 processes (gloo): FSDP2 (noise + centralization + cautious AdamW, 3 steps), a gradient sharded on
    dim 0, on dim 1 (a row's mean over both ranks) and replicated, and DDP's plain gradients: as one
    process, float64 (``tests/distributed/techniques_worker.py``)."""
    done = torchrun(2, [worker("techniques_worker.py")], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.split("RESULTS ", 1)[1].splitlines()[0])
    # float64 (the worker's docstring): 1.1e-16 per operation through 3 steps of a small MLP on values ~1,
    # ~1e-14; 1e-12 is 100x that. DDP's replicas draw the same noise: exactly equal
    assert got["fsdp2"] <= 1e-12 and got["placements"] <= 1e-12 and got["ddp"] == 0.0, got
