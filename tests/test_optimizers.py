"""Optimizers against their published update rules, reference implementations, and exact resume."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer
from lmforge.optim.lion import Lion
from lmforge.train.checkpoint import latest_checkpoint
from lmforge.train.loop import train


def _one_param(values, grads_seq, make):
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    opt = make([p])
    for g in grads_seq:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return p.detach()


def test_lion_hand_computed():
    lr, wd, b1, b2 = 0.1, 0.5, 0.9, 0.99
    g1, g2 = [0.5, -0.1, 0.0], [-1.0, -0.2, 0.3]
    p = _one_param([1.0, -2.0, 3.0], [g1, g2], lambda ps: Lion(ps, lr=lr, betas=(b1, b2), weight_decay=wd))
    # step 1: m = 0 -> c = 0.1 g1, sign = [1, -1, 0]; p <- p (1 - 0.05) - 0.1 sign
    p1 = [1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1, 3.0 * 0.95]
    m1 = [0.01 * g for g in g1]
    # step 2: c = 0.9 m1 + 0.1 g2 = [0.0045 - 0.1, -0.0009 - 0.02, 0.03] -> sign [-1, -1, 1]
    want = [p1[0] * 0.95 + 0.1, p1[1] * 0.95 + 0.1, p1[2] * 0.95 - 0.1]
    assert [0.9 * m + 0.1 * g > 0 for m, g in zip(m1, g2, strict=True)] == [False, False, True]
    torch.testing.assert_close(p, torch.tensor(want, dtype=torch.float64))


def test_lion_matches_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 7))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Lion([a], lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    ref = lion_pytorch.Lion([b], lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    for _ in range(6):
        g = torch.randn(5, 7)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_adamw_first_steps_hand_computed():
    lr, wd, eps, (b1, b2) = 0.01, 0.1, 1e-8, (0.9, 0.95)
    g1, g2 = 0.5, -0.25
    p = _one_param(
        [2.0], [[g1], [g2]], lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    )
    x = 2.0 * (1 - lr * wd) - lr * g1 / (abs(g1) + eps)  # bias-corrected first step: m_hat = g, v_hat = g^2
    m = (1 - b1) * g1 * b1 + (1 - b1) * g2
    v = (1 - b2) * g1**2 * b2 + (1 - b2) * g2**2
    m_hat, v_hat = m / (1 - b1**2), v / (1 - b2**2)
    x = x * (1 - lr * wd) - lr * m_hat / (v_hat**0.5 + eps)
    assert float(p[0]) == pytest.approx(x, rel=1e-12)


def test_sgd_nesterov_hand_computed():
    lr, mu = 0.1, 0.9
    p = _one_param([1.0], [[1.0], [2.0]], lambda ps: torch.optim.SGD(ps, lr=lr, momentum=mu, nesterov=True))
    # buf1 = g1 = 1; step = g1 + mu buf1 = 1.9; buf2 = mu buf1 + g2 = 2.9; step = g2 + mu buf2 = 4.61
    assert float(p[0]) == pytest.approx(1.0 - 0.1 * 1.9 - 0.1 * 4.61)


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lion", "adafactor"])
def test_build_each_optimizer_and_step(name):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=4), 64, 16)
    opt = build_optimizer(m, OptimConfig(name=name, lr=1e-2), torch.device("cpu"))
    x = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(5):
        s, n = m.loss(x, x)
        (s / n).backward()
        opt.step()
        opt.zero_grad()
        losses.append((s / n).item())
    assert losses[-1] < losses[0], losses
    if name == "adafactor":  # factored second moments: a row and a column vector per matrix
        state = opt.state[m.blocks[0].attn.q_proj.weight]
        assert state["row_var"].numel() == 32 and state["col_var"].numel() == 32


@pytest.mark.parametrize("name", ["adam", "sgd", "lion", "adafactor"])
def test_optimizer_state_survives_resume(name, tiny_config, tmp_path):
    cfg = tiny_config.model_copy(deep=True)
    cfg.optim.name = name
    cfg.train.eval_interval = 0
    cfg.train.sample_tokens = 0
    train(cfg, tmp_path / "a", progress_bar=False)
    train(cfg, tmp_path / "b", progress_bar=False, stop_at=10)
    train(cfg, tmp_path / "b", resume=True, progress_bar=False)
    a = torch.load(latest_checkpoint(tmp_path / "a") / "state.pt", weights_only=False)
    b = torch.load(latest_checkpoint(tmp_path / "b") / "state.pt", weights_only=False)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for k, state in a["optimizer"]["state"].items():
        for sk, sv in state.items():
            assert torch.equal(torch.as_tensor(sv), torch.as_tensor(b["optimizer"]["state"][k][sk])), (k, sk)
