"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
appendix A.1): pure formulas, their moving averages, and the one measurement a training step adds.

With ``G`` the true gradient and ``Sigma`` the per-example gradient covariance, the mean gradient of a
batch of ``B`` independent examples has ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``. Two batch sizes
``B_small < B_big`` give unbiased estimates of both terms (:func:`true_grad_sq`, :func:`noise_trace`);
their ratio is the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (:func:`critical_batch`), the batch
size around which larger batches stop paying off. Each single-step estimate is very noisy, so the
numerator and the denominator are each smoothed (an exponential moving average) before dividing, as the
paper recommends (:class:`NoiseScale`).

In a training step, ``B_small`` is the first micro-batch's target tokens and ``G_small`` its mean-per-token
gradient (:func:`first_micro_batch_sq`); ``B_big`` is the step's target tokens and ``G_big`` the step's
gradient, so the unit of ``B_simple`` is tokens. The step metrics log it (``train/callbacks/metrics.py``)
and the noise-driven batch-size schedule follows it (``optim/batch_schedule.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

Number = float | torch.Tensor


def true_grad_sq(b_small: float, sq_small: Number, b_big: float, sq_big: Number) -> Number:
    """Unbiased ``|G|^2``: ``(B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)``."""
    return (b_big * sq_big - b_small * sq_small) / (b_big - b_small)


def noise_trace(b_small: float, sq_small: Number, b_big: float, sq_big: Number) -> Number:
    """Unbiased ``S = tr(Sigma)``: ``(|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)``."""
    return (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)


def critical_batch(trace: float, grad_sq: float) -> float:
    """The simple noise scale ``B_simple = S / |G|^2`` (NaN when ``|G|^2`` is not above 0: with small
    batches the estimate of ``|G|^2`` can come out negative while noise dominates)."""
    return trace / grad_sq if grad_sq > 0 else float("nan")


class NoiseScale:
    """Exponential moving averages (weight ``1 - beta`` for the newest step) of ``S`` and ``|G|^2``; kept
    on the gradients' device, so updating never waits for it. Both averages start at 0 and carry the same
    ``1 - beta^n`` bias, which cancels in :meth:`value`'s ratio."""

    def __init__(self, beta: float = 0.95):
        self.beta = beta
        self.trace: Number = 0.0
        self.grad_sq: Number = 0.0
        self.count = 0

    def update(self, b_small: float, sq_small: Number, b_big: float, sq_big: Number) -> None:
        """One step's two squared gradient norms (``|G_small|^2`` over ``b_small`` examples, ``|G_big|^2``
        over ``b_big > b_small``)."""
        if not b_big > b_small > 0:
            raise ValueError(f"noise scale: need 0 < B_small < B_big, got {b_small} and {b_big}")
        a = self.beta
        self.trace = a * self.trace + (1 - a) * noise_trace(b_small, sq_small, b_big, sq_big)
        self.grad_sq = a * self.grad_sq + (1 - a) * true_grad_sq(b_small, sq_small, b_big, sq_big)
        self.count += 1

    def smoothed(self) -> tuple[float, float]:
        """The averages ``(S, |G|^2)``, each divided by ``1 - beta^n`` (unbiased for a constant input;
        synchronises with the device); NaN before the first update."""
        if not self.count:
            return float("nan"), float("nan")
        debias = 1 - self.beta**self.count
        return float(self.trace) / debias, float(self.grad_sq) / debias

    def value(self) -> float:
        """``B_simple`` of the averages (synchronises with the device); NaN before the first update."""
        return critical_batch(*self.smoothed())

    def state_dict(self) -> dict:
        """The raw averages as numbers (a float32 average is exact as a Python float) and the count."""
        return {"trace": float(self.trace), "grad_sq": float(self.grad_sq), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        """Averages back as float32 tensors once updated, so later updates round as the saved run's did."""
        self.count = int(state["count"])
        as_avg = (lambda v: torch.tensor(v, dtype=torch.float32)) if self.count else float
        self.trace, self.grad_sq = as_avg(state["trace"]), as_avg(state["grad_sq"])


def first_micro_batch_sq(
    params: Iterable[torch.nn.Parameter], n_targets: int, step_targets: int, dp: int, loss_scale: float | None
) -> torch.Tensor | None:
    """``|G_small|^2`` after the first micro-batch's backward, on the gradients' device (no host sync):
    the accumulated gradient is ``dp * grad(loss_sum_1) / step_targets`` (times the fp16 loss scale), so it
    is rescaled by ``step_targets / (dp * n_targets)`` (and ``1 / loss_scale``) to the first micro-batch's
    own mean per token. None when no parameter has a gradient or the micro-batch has no targets."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or n_targets == 0:
        return None
    sq = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    factor = step_targets / (dp * n_targets)
    if loss_scale is not None:
        factor /= loss_scale
    return sq * factor**2
