"""Learning-rate schedules: pure functions of the step returning a multiplier of the peak rate.

All schedules share a linear warmup: ``m(s) = (s + 1) / warmup`` for ``s < warmup``. After warmup,
with progress ``p = (s - warmup) / (total - warmup)`` clamped to [0, 1] and floor ``r = min_lr_ratio``:

* ``constant``: ``m = 1``
* ``linear``:   ``m = 1 - (1 - r) * p``
* ``cosine``:   ``m = r + (1 - r) * (1 + cos(pi * p)) / 2``
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lmforge.config import ScheduleConfig


def warmup_factor(step: int, warmup: int) -> float | None:
    """``(step + 1) / warmup`` during warmup, else None."""
    if step < warmup:
        return (step + 1) / warmup
    return None


def progress(step: int, warmup: int, total: int) -> float:
    """``(step - warmup) / (total - warmup)`` clamped to [0, 1]."""
    span = max(1, total - warmup)
    return min(1.0, max(0.0, (step - warmup) / span))


def constant(step: int, total: int, warmup: int, min_lr_ratio: float) -> float:
    return warmup_factor(step, warmup) or 1.0


def linear(step: int, total: int, warmup: int, min_lr_ratio: float) -> float:
    w = warmup_factor(step, warmup)
    return w if w is not None else 1.0 - (1.0 - min_lr_ratio) * progress(step, warmup, total)


def cosine(step: int, total: int, warmup: int, min_lr_ratio: float) -> float:
    w = warmup_factor(step, warmup)
    if w is not None:
        return w
    p = progress(step, warmup, total)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


SCHEDULES: dict[str, Callable[[int, int, int, float], float]] = {
    "constant": constant,
    "linear": linear,
    "cosine": cosine,
}


def lr_multiplier(cfg: ScheduleConfig, step: int, total: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based) of ``total``."""
    return SCHEDULES[cfg.name](step, total, cfg.warmup, cfg.min_lr_ratio)
