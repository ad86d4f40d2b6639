"""The gradient noise scale estimators (``train/callbacks/metrics.py``) on synthetic gradients of known noise."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.optim.noise_scale import NoiseScale, critical_batch, noise_trace, true_grad_sq


def _two_batches(trials: int, b_small: int, b_big: int, dim: int, seed: int = 0):
    """Per-example gradients ``g_i = G + noise_i`` (noise ~ N(0, diag(var))): for each trial the squared
    norms of the mean over the first ``b_small`` examples and over all ``b_big`` of them, nested as in a
    step (the first micro-batch is part of the step), plus the true ``|G|^2`` and ``tr(Sigma)``."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.3
    var = torch.rand(dim, generator=gen, dtype=torch.float64) * 2.0
    noise = torch.randn(trials, b_big, dim, generator=gen, dtype=torch.float64) * var.sqrt()
    examples = g + noise
    sq_small = examples[:, :b_small].mean(1).square().sum(1)
    sq_big = examples.mean(1).square().sum(1)
    return sq_small, sq_big, float(g.square().sum()), float(var.sum())


def _close_in_mean(samples: torch.Tensor, truth: float) -> None:
    se = float(samples.std()) / math.sqrt(len(samples))
    # the sample mean's own standard error: 4 of them is a 6e-5 two-sided chance for a seeded draw
    assert abs(float(samples.mean()) - truth) < 4 * se, (float(samples.mean()), truth, se)


def test_estimators_are_unbiased_on_nested_batches():
    sq_small, sq_big, g_sq, trace = _two_batches(trials=4000, b_small=4, b_big=16, dim=64)
    _close_in_mean(true_grad_sq(4, sq_small, 16, sq_big), g_sq)
    _close_in_mean(noise_trace(4, sq_small, 16, sq_big), trace)
    # the naive |G_big|^2 is biased by tr(Sigma) / B_big: far outside the same tolerance
    assert float(sq_big.mean()) - g_sq > 0.5 * trace / 16


# The exact-value tests compare float64 formulas with pytest.approx's default (1e-6): rounding only.


def test_exact_expectations_give_exact_values():
    g_sq, trace = 2.5, 40.0
    sq = {b: g_sq + trace / b for b in (8, 32)}  # E|G_B|^2 = |G|^2 + tr(Sigma) / B
    assert true_grad_sq(8, sq[8], 32, sq[32]) == pytest.approx(g_sq)
    # the same default (see the note above): float64 formulas on exact inputs, rounding only
    assert noise_trace(8, sq[8], 32, sq[32]) == pytest.approx(trace)
    assert critical_batch(trace, g_sq) == pytest.approx(16.0)
    assert math.isnan(critical_batch(trace, 0.0))


def test_smoothed_ratio_converges_to_b_simple():
    sq_small, sq_big, g_sq, trace = _two_batches(trials=3000, b_small=8, b_big=32, dim=32, seed=1)
    gns = NoiseScale(beta=0.995)
    assert math.isnan(gns.value())
    for a, b in zip(sq_small, sq_big, strict=True):
        gns.update(8, a, 32, b)
    # sampling error, not rounding: 3000 seeded draws of noisy squared norms, averaged with beta = 0.995
    # (an effective 200 samples); measured 1.7% off for seed 1, 0.15 is the spread such an average allows
    assert gns.value() == pytest.approx(trace / g_sq, rel=0.15)
    # the ratio of the two averages (their common 1 - beta^n bias cancels); approx's default: float64 rounding
    assert gns.value() == pytest.approx(float(gns.trace) / float(gns.grad_sq))


def test_smoothed_values_are_debiased():
    gns = NoiseScale(beta=0.9)
    for _ in range(3):
        gns.update(8, 2.5 + 40.0 / 8, 32, 2.5 + 40.0 / 32)  # constant input: the averages give it back
    # approx's default rel 1e-6: float64 averages of a constant, debiased, against the hand values: rounding
    assert gns.smoothed() == pytest.approx((40.0, 2.5))
    assert gns.value() == pytest.approx(16.0)


def test_needs_two_batch_sizes():
    with pytest.raises(ValueError, match="B_small < B_big"):
        NoiseScale().update(8, 1.0, 8, 1.0)
