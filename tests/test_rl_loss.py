"""The RL formulas against hand computations (numpy, written from the papers' definitions): advantages of
GRPO, Dr. GRPO and RLOO; each policy loss on a fixed batch; the k3 KL estimator; and the gradient of a
ratio that is 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmforge.posttrain.rl_loss import group_advantages, k3, policy_loss

REWARDS = np.array([[1.0, 0.0, 0.5, 0.0], [0.2, 0.2, 0.9, 0.1]])


def test_advantages_by_hand():
    r = torch.tensor(REWARDS)
    for g in range(2):
        row = REWARDS[g]
        mean, std = row.mean(), row.std(ddof=1)
        grpo = group_advantages(r, "grpo")[g].numpy()
        # here and below: advantages are FP32 (u = 6e-8) vs float64: input rounding and a 4-term mean, ~u max|r|
        # / |r - mean| = 6e-8 x 0.9 / 0.15 = 4e-7 (row 1; row 0 is exact in FP32), rtol 1e-6 is ~2.5x that;
        # atol 1e-7 (~2u at |r| <= 1) for differences near 0
        np.testing.assert_allclose(grpo, (row - mean) / (std + 1e-4), rtol=1e-6)
        np.testing.assert_allclose(
            group_advantages(r, "dr_grpo")[g].numpy(), row - mean, rtol=1e-6, atol=1e-7
        )
        others = np.array([(row.sum() - row[i]) / 3 for i in range(4)])
        np.testing.assert_allclose(group_advantages(r, "rloo")[g].numpy(), row - others, rtol=1e-6, atol=1e-7)
    assert float(group_advantages(torch.ones(1, 4), "grpo").abs().max()) == 0.0  # one reward: no signal
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2, 1), "grpo")


# a fixed batch: 2 groups of G = 2, completions of 3, 2, 1 and 3 tokens
LOGP = np.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0], [-0.7, 0.0, 0.0], [-1.5, -0.2, -0.9]])
OLD = np.array([[-1.3, -0.5, -1.7], [-0.1, -1.0, 0.0], [-0.6, 0.0, 0.0], [-1.0, -0.4, -0.9]])
REF = np.array([[-0.9, -0.7, -2.2], [-0.3, -1.0, 0.0], [-1.0, 0.0, 0.0], [-1.4, -0.2, -1.1]])
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=float)
ADV = np.array([1.0, -1.0, 0.5, -0.5])
EPS, BETA, T = 0.2, 0.1, 4


def _hand_tokens() -> tuple[np.ndarray, np.ndarray]:
    """The per-token loss ``-min(rho A, clip(rho) A) + beta k3`` and k3, by the formulas."""
    rho = np.exp(LOGP - OLD)
    a = ADV[:, None]
    surrogate = -np.minimum(rho * a, np.clip(rho, 1 - EPS, 1 + EPS) * a)
    d = REF - LOGP
    kl = np.exp(d) - d - 1
    return (surrogate + BETA * kl) * MASK, kl * MASK


def _loss(variant: str):
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    return policy_loss(t(LOGP), t(OLD), t(REF), t(MASK), t(ADV), 2, variant, EPS, BETA, T)


def test_grpo_losses_equal_hand_computation():
    tokens, kl = _hand_tokens()
    lengths = MASK.sum(1)
    per_seq = tokens.sum(1) / lengths
    grpo = [per_seq[0:2].mean(), per_seq[2:4].mean()]
    dr = [tokens[0:2].sum() / (2 * T), tokens[2:4].sum() / (2 * T)]
    dapo = [tokens[0:2].sum() / lengths[0:2].sum(), tokens[2:4].sum() / lengths[2:4].sum()]
    for variant, expected in (("grpo", grpo), ("dr_grpo", dr), ("dapo", dapo)):
        parts = _loss(variant)
        # float64 losses of <= 3-token rows, the same formulas in torch and numpy: ~1e-15; rtol 1e-12 is margin
        np.testing.assert_allclose(parts.groups.detach().numpy(), expected, rtol=1e-12, err_msg=variant)
        np.testing.assert_allclose(float(parts.kl_sum), kl.sum(), rtol=1e-12)
    # the clip binds where rho leaves [0.8, 1.2] on the side the advantage points to
    rho = np.exp(LOGP - OLD)
    a = ADV[:, None]
    binds = ((rho > 1 + EPS) & (a > 0)) | ((rho < 1 - EPS) & (a < 0))
    assert float(_loss("grpo").clipped) == (binds & (MASK > 0)).sum() > 0


def test_rloo_loss_equals_hand_computation():
    _, kl = _hand_tokens()
    rho = np.exp(((LOGP - OLD) * MASK).sum(1))
    surrogate = -np.minimum(rho * ADV, np.clip(rho, 1 - EPS, 1 + EPS) * ADV)
    per_seq = surrogate + BETA * kl.sum(1)
    parts = _loss("rloo")
    # float64, as above: ~1e-15 of rounding, rtol 1e-12 is margin
    np.testing.assert_allclose(
        parts.groups.detach().numpy(), [per_seq[0:2].mean(), per_seq[2:4].mean()], rtol=1e-12
    )


def test_k3_is_zero_at_the_reference_and_never_negative():
    p = torch.tensor([-1.0, -0.1, -3.0])
    assert torch.equal(k3(p, p), torch.zeros(3))
    assert bool((k3(p, p + torch.tensor([0.5, -0.3, 1.0])) > 0).all())


def test_ratio_one_still_gives_the_policy_gradient():
    """One update per batch: ``old = logp.detach()``, the ratio is 1 and the loss's value is ``-A`` per
    token, but its gradient is ``-A m / (|o| G)`` (grpo), the policy gradient, not zero."""
    logp = torch.tensor(LOGP, requires_grad=True)
    parts = policy_loss(
        logp, logp.detach(), None, torch.tensor(MASK), torch.tensor(ADV), 2, "grpo", EPS, 0.0, T
    )
    parts.groups.sum().backward()
    expected = -ADV[:, None] * MASK / MASK.sum(1, keepdims=True) / 2
    # ratio exp(0) = 1 exactly: the gradient is -A m / (|o| G) up to a rounding or two in float64 (~1e-16)
    np.testing.assert_allclose(logp.grad.numpy(), expected, rtol=1e-12)
    assert float(parts.clipped) == 0
