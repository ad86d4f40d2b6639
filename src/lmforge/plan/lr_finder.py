"""The learning-rate range test (L. N. Smith, "Cyclical Learning Rates for Training Neural Networks",
2017): train a few steps while the learning rate grows geometrically, watch where the loss falls fastest.

Pure rules only (this module allocates nothing); ``lmforge/probes/lr_find.py`` runs the sweep.

* Sweep: step ``i`` of ``n`` uses ``lr_i = a * (b / a) ^ (i / (n - 1))`` from ``a = start_lr`` to
  ``b = end_lr``.
* Smoothing: bias-corrected exponential moving average of the loss, ``v_i = beta v_{i-1} + (1 - beta)
  loss_i`` (``v_{-1} = 0``) and ``s_i = v_i / (1 - beta^(i + 1))``.
* Divergence: the sweep stops after step ``i`` when the loss is not finite or ``s_i > diverge_factor *
  min_{j <= i} s_j``.
* Suggestion: the learning rate where the smoothed loss falls fastest against ``log lr`` (the most
  negative central difference ``(s_{i+1} - s_{i-1}) / (log lr_{i+1} - log lr_{i-1})``), searched from
  the first step after the first tenth of the sweep (while the moving average still settles) up to the
  minimum of the smoothed curve. Also reported: the learning rate of that minimum divided by 10, a
  second, more conservative rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def sweep_lr(i: int, n: int, start: float, end: float) -> float:
    """``start * (end / start) ^ (i / (n - 1))``: geometric from ``start`` (i = 0) to ``end`` (i = n - 1)."""
    return start * (end / start) ** (i / max(1, n - 1))


def smooth(losses: list[float], beta: float) -> list[float]:
    """Bias-corrected EMA: ``v_i = beta v_{i-1} + (1 - beta) x_i``, ``s_i = v_i / (1 - beta^(i+1))``."""
    out, v = [], 0.0
    for i, x in enumerate(losses):
        v = beta * v + (1.0 - beta) * x
        out.append(v / (1.0 - beta ** (i + 1)))
    return out


def diverged(loss: float, smoothed: list[float], factor: float) -> bool:
    """True when ``loss`` is not finite or the newest smoothed value exceeds ``factor`` times the minimum."""
    return not math.isfinite(loss) or smoothed[-1] > factor * min(smoothed)


@dataclass
class Suggestion:
    lr: float  # steepest descent of the smoothed loss (the suggestion)
    index: int  # its step in the sweep
    min_lr: float  # learning rate at the smoothed minimum
    min_over_10: float  # min_lr / 10


def suggest(lrs: list[float], smoothed: list[float]) -> Suggestion:
    """Steepest negative slope of ``smoothed`` against ``log lr`` before its minimum (see module docstring)."""
    if len(lrs) != len(smoothed) or len(lrs) < 3:
        raise ValueError("suggest: need at least three points of the sweep")
    low = min(range(len(smoothed)), key=smoothed.__getitem__)
    first = max(1, len(lrs) // 10)
    last = min(max(low, first + 1), len(lrs) - 2)
    best, best_slope = first, math.inf
    for i in range(first, last + 1):
        slope = (smoothed[i + 1] - smoothed[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1]))
        if slope < best_slope:
            best, best_slope = i, slope
    return Suggestion(lr=lrs[best], index=best, min_lr=lrs[low], min_over_10=lrs[low] / 10)
