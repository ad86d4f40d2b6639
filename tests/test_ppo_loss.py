"""PPO's formulas against hand computations: per-token rewards, GAE (numbers worked out by hand in the
comments), whitening, explained variance, and the clipped policy + value loss on a fixed batch where both
clips bind (numpy, written from the definitions in Schulman et al. 2016 and 2017)."""

from __future__ import annotations

import numpy as np
import torch

from lmforge.posttrain.ppo_loss import (
    explained_variance,
    explained_variance_sums,
    gae,
    ppo_loss,
    token_rewards,
    whiten,
)

# two rows of 4 positions: row 0 a prompt position then 3 completion tokens, row 1 a prompt position, 2
# completion tokens and a padding position; off the mask, junk numbers that must not leak in
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
REWARDS = torch.tensor([[9.0, 0.0, 0.0, 1.0], [9.0, -0.1, 0.5, 9.0]], dtype=torch.float64)
VALUES = torch.tensor([[7.0, 0.5, 0.6, 0.8], [7.0, 0.2, 0.4, 7.0]], dtype=torch.float64)


def test_gae_equals_hand_computation():
    # gamma = 1, lambda = 0.5. Row 0: delta_3 = 1 - 0.8 = 0.2, A_3 = 0.2; delta_2 = 0.8 - 0.6 = 0.2,
    # A_2 = 0.2 + 0.5 * 0.2 = 0.3; delta_1 = 0.6 - 0.5 = 0.1, A_1 = 0.1 + 0.5 * 0.3 = 0.25; R = A + V.
    # Row 1: delta_2 = 0.5 - 0.4 = 0.1, A_2 = 0.1; delta_1 = -0.1 + 0.4 - 0.2 = 0.1, A_1 = 0.15.
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=0.5)
    hand_adv = [[0, 0.25, 0.3, 0.2], [0, 0.15, 0.1, 0]]
    hand_ret = [[0, 0.75, 0.9, 1.0], [0, 0.35, 0.5, 0]]
    # float64 GAE recursion of <= 3 steps on one-decimal inputs vs the hand decimals: rounding ~1e-16, 1e-12 is margin
    torch.testing.assert_close(adv, torch.tensor(hand_adv, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(hand_ret, dtype=torch.float64), rtol=0, atol=1e-12)
    # gamma = 0.5, lambda = 1 (Monte-Carlo): row 0: delta_3 = 0.2, A_3 = 0.2; delta_2 = 0.5 * 0.8 - 0.6
    # = -0.2, A_2 = -0.2 + 0.5 * 0.2 = -0.1; delta_1 = 0.5 * 0.6 - 0.5 = -0.2, A_1 = -0.2 - 0.05 = -0.25;
    # the returns are the discounted rewards to go: 0.25, 0.5, 1
    adv, ret = gae(REWARDS[:1], VALUES[:1], MASK[:1], gamma=0.5, lam=1.0)
    # same source: a 3-step float64 recursion against hand decimals, rounding ~1e-16
    torch.testing.assert_close(
        adv[0], torch.tensor([0, -0.25, -0.1, 0.2], dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        ret[0], torch.tensor([0, 0.25, 0.5, 1.0], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_token_rewards_put_the_score_on_the_last_token_and_the_kl_on_every_token():
    old = torch.tensor([[-5.0, -1.0, -0.5, -2.0], [-5.0, -0.3, -1.2, -5.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, -0.9, -0.7, -2.2], [-1.0, -0.3, -1.0, -1.0]], dtype=torch.float64)
    scores = torch.tensor([1.0, 0.5], dtype=torch.float64)
    out = token_rewards(scores, old, ref, MASK, beta=0.1)
    # -0.1 (old - ref): row 0: -0.1 * -0.1 = 0.01, -0.1 * 0.2 = -0.02, -0.1 * 0.2 = -0.02, + 1 on the last;
    # row 1: 0, -0.1 * -0.2 = 0.02, + 0.5 on the last completion token (position 2)
    hand = [[0, 0.01, -0.02, 0.98], [0, 0.0, 0.52, 0]]
    # float64 products and sums of a few one-decimal numbers vs the hand decimals: rounding ~1e-16
    torch.testing.assert_close(out, torch.tensor(hand, dtype=torch.float64), rtol=0, atol=1e-12)
    no_kl = token_rewards(scores, old, None, MASK, beta=0.1)
    # exact (the scores copied to the last token); assert_close's float64 default (rtol = atol = 1e-7) is room
    torch.testing.assert_close(no_kl, torch.tensor([[0, 0, 0, 1.0], [0, 0, 0.5, 0]], dtype=torch.float64))


def test_whitening_and_explained_variance_by_hand():
    x = torch.tensor([[5.0, 1.0, 2.0, 3.0], [5.0, 4.0, 6.0, 5.0]], dtype=torch.float64)
    on = np.array([1.0, 2.0, 3.0, 4.0, 6.0])  # the masked entries
    hand = (on - on.mean()) / np.sqrt(on.var() + 1e-8)
    w = whiten(x, MASK)
    # rtol 1e-12: float64 mean and variance of 5 numbers, torch vs numpy summation order: ~1e-15 relative
    np.testing.assert_allclose(w[MASK].numpy(), hand, rtol=1e-12)
    assert float(w[~MASK].abs().max()) == 0.0
    returns, values = x, VALUES
    r, v = on, np.array([0.5, 0.6, 0.8, 0.2, 0.4])
    ev = explained_variance(explained_variance_sums(returns, values, MASK))
    # rtol 1e-10: one-pass float64 variance E[x^2] - E[x]^2 cancels ~4x here (13.2 vs 2.96): ~1e-15 relative
    np.testing.assert_allclose(ev, 1 - np.var(r - v) / np.var(r), rtol=1e-10)
    ev_same = explained_variance(explained_variance_sums(returns, returns, MASK))
    assert ev_same == 1.0


# a fixed batch: 2 groups of G = 2 (one row each of 3 completion positions), ratios and values moved away
# from sampling so that both clips bind somewhere
LOGP = np.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0], [-0.7, 0.0, 0.0], [-1.5, -0.2, -0.9]])
OLD = np.array([[-1.3, -0.5, -1.7], [-0.1, -1.0, 0.0], [-0.6, 0.0, 0.0], [-1.0, -0.4, -0.9]])
V = np.array([[0.3, 0.5, 0.9], [0.1, -0.2, 0.0], [0.4, 0.0, 0.0], [0.0, 0.7, 0.2]])
V_OLD = np.array([[0.2, 0.1, 0.95], [0.1, 0.1, 0.0], [0.35, 0.0, 0.0], [0.5, 0.6, 0.2]])
RET = np.array([[1.0, 0.0, 1.2], [-0.5, 0.3, 0.0], [0.0, 0.0, 0.0], [0.2, 0.4, 0.9]])
ADV = np.array([[1.0, -0.5, 2.0], [-1.0, 0.3, 0.0], [0.5, 0.0, 0.0], [-0.5, 1.5, -2.0]])
PMASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=float)
EPS, EPS_V, C_V = 0.2, 0.2, 0.5


def test_ppo_loss_equals_hand_computation():
    rho = np.exp(LOGP - OLD)
    policy = -np.minimum(rho * ADV, np.clip(rho, 1 - EPS, 1 + EPS) * ADV)
    v_clip = V_OLD + np.clip(V - V_OLD, -EPS_V, EPS_V)
    value = 0.5 * np.maximum((V - RET) ** 2, (v_clip - RET) ** 2)
    tokens = (policy + C_V * value) * PMASK
    per_seq = tokens.sum(1) / PMASK.sum(1)
    groups = per_seq.reshape(2, 2).mean(1)
    clipped = ((np.clip(rho, 1 - EPS, 1 + EPS) * ADV < rho * ADV) * PMASK).sum()
    assert clipped > 0 and (np.abs(V - V_OLD) > EPS_V).any()  # both clips are exercised
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    logp = t(LOGP).requires_grad_(True)
    parts = ppo_loss(logp, t(OLD), t(V), t(V_OLD), t(RET), t(ADV), t(PMASK) > 0, 2, EPS, EPS_V, C_V)
    # float64 loss of 3-token rows, the same formulas in torch and numpy: a few roundings, ~1e-15; 1e-12 is margin
    np.testing.assert_allclose(parts.groups.detach().numpy(), groups, rtol=1e-12)
    np.testing.assert_allclose(float(parts.value_loss_sum), (value * PMASK).sum(), rtol=1e-12)
    assert float(parts.clipped) == clipped and float(parts.tokens) == PMASK.sum()
    # at ratio 1 (one update per batch) the gradient is the policy gradient -A / |o| / G per token
    same = t(OLD).requires_grad_(True)
    ppo_loss(
        same, t(OLD), t(V), t(V), t(RET), t(ADV), t(PMASK) > 0, 2, EPS, EPS_V, 0.0
    ).groups.sum().backward()
    hand_grad = -ADV * PMASK / PMASK.sum(1, keepdims=True) / 2
    # ratio exp(0) = 1 exactly, so the gradient is -A / |o| / G up to a rounding or two in float64 (~1e-16)
    np.testing.assert_allclose(same.grad.numpy(), hand_grad, rtol=1e-12)
