"""Pure statistics for comparing arms of an experiment: mean, sample standard deviation and Welch's
unequal-variance t-test, two-sided, with the Welch-Satterthwaite degrees of freedom.

No scipy: the t distribution's CDF comes from the regularized incomplete beta function, evaluated by its
continued fraction (modified Lentz; Press et al., Numerical Recipes, 3rd ed., section 6.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-15
_TINY = 1e-300
_MAX_ITER = 500


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    return math.fsum(values) / len(values) if values else math.nan


def sample_sd(values: Sequence[float]) -> float:
    """Sample standard deviation ``sqrt(sum (x - mean)^2 / (n - 1))``; NaN for fewer than 2 values."""
    if len(values) < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(math.fsum((x - m) ** 2 for x in values) / (len(values) - 1))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (converges fast for x < (a+1)/(a+b+2))."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_ITER + 1):
        for aa in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + aa / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b) = B(x; a, b) / B(a, b)`` for a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """``P(|T| >= |t|)`` for Student's t with ``df`` (real, > 0) degrees of freedom:
    ``I_{df / (df + t^2)}(df / 2, 1 / 2)``."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


@dataclass(frozen=True)
class Welch:
    """Welch's t-test of ``b`` against ``a``: ``diff = mean(b) - mean(a)``,
    ``t = diff / sqrt(s_a^2 / n_a + s_b^2 / n_b)``, the Welch-Satterthwaite degrees of freedom
    ``df = (s_a^2/n_a + s_b^2/n_b)^2 / ((s_a^2/n_a)^2 / (n_a - 1) + (s_b^2/n_b)^2 / (n_b - 1))`` and the
    two-sided p-value. ``t``, ``df`` and ``p`` are None when undefined: fewer than 2 values in a sample,
    or no spread in either."""

    diff: float
    t: float | None
    df: float | None
    p: float | None


def welch_test(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Welch's two-sided t-test of sample ``b`` against sample ``a`` (see :class:`Welch`)."""
    diff = mean(b) - mean(a) if a and b else math.nan
    if len(a) < 2 or len(b) < 2:
        return Welch(diff, None, None, None)
    va, vb = sample_sd(a) ** 2 / len(a), sample_sd(b) ** 2 / len(b)
    if va + vb == 0.0:
        return Welch(diff, None, None, None)
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return Welch(diff, t, df, t_two_sided_p(t, df))


@dataclass(frozen=True)
class OneSample:
    """Student's one-sample t-test of ``values`` against ``mu``: ``diff = mean - mu``,
    ``t = diff / (s / sqrt(n))`` with ``s`` the sample standard deviation, ``df = n - 1`` and the two-sided
    p-value. A paired test of ``after`` against ``before`` is this test of the differences against 0.
    ``t``, ``df`` and ``p`` are None when undefined: fewer than 2 values, or no spread."""

    diff: float
    t: float | None
    df: float | None
    p: float | None


def one_sample_test(values: Sequence[float], mu: float = 0.0) -> OneSample:
    """Student's two-sided one-sample t-test of ``values`` against ``mu`` (see :class:`OneSample`)."""
    diff = mean(values) - mu if values else math.nan
    if len(values) < 2 or sample_sd(values) == 0.0:
        return OneSample(diff, None, None, None)
    t = diff / (sample_sd(values) / math.sqrt(len(values)))
    df = float(len(values) - 1)
    return OneSample(diff, t, df, t_two_sided_p(t, df))
