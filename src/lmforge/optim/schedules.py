"""Learning-rate schedules: the multiplier ``m(s)`` of the peak rate at optimizer step ``s`` (0-based).

Every schedule but ``plateau`` is a pure function of ``(s, T)`` with ``T`` the total number of steps.
Notation: ``W`` warmup steps (``schedule.warmup``: a count, or a fraction of ``T`` when below 1),
``r = min_lr_ratio``, progress after warmup ``p = clamp((s - W) / (T - W), 0, 1)``. A schedule's own
settings are in the sub-table named after it (``decay_fraction`` is ``schedule.wsd.decay_fraction``).

Warmup (all but ``one_cycle``, which has its own rise): ``m = (s + 1) / W`` for ``s < W``. After it:

* ``constant``:     ``m = 1``
* ``linear``:       ``m = 1 - (1 - r) p``
* ``cosine``:       ``m = r + (1 - r) (1 + cos(pi p)) / 2``
* ``wsd``:          ``m = 1`` until ``D = T - round(decay_fraction * T)``, then with ``q = (s - D) / (T - D)``:
  linear ``1 - (1 - r) q``, cosine ``r + (1 - r)(1 + cos(pi q)) / 2``, 1-sqrt ``1 - (1 - r) sqrt(q)``.
  The decay is anchored to ``T``: a run resumed in its stable phase with a larger ``T`` decays at the new end.
* ``step``:         ``m = max(r, gamma ^ floor((s - W) / step_size))``
* ``polynomial``:   ``m = r + (1 - r) (1 - p) ^ power``
* ``exponential``:  ``m = r ^ p`` (from 1 down to ``r`` geometrically; ``r`` must be > 0)
* ``inverse_sqrt``: ``m = sqrt(max(W, 1) / max(s + 1, W, 1))``
* ``cyclic``:       triangular between ``r`` and 1 with half-period ``h = cycle_steps / 2``:
  ``m = r + (1 - r) (1 - |((s - W) mod 2h) / h - 1|)``, starting at ``r``
* ``one_cycle``:    rise over the first ``W`` steps from ``a = 1 / div_factor`` to 1 by half a cosine,
  ``m = a + (1 - a)(1 - cos(pi s / W)) / 2``, then ``cosine`` from 1 to ``r`` over the rest
* ``plateau``:      warmup, then ``m = f``, where ``f`` starts at 1 and is multiplied by ``factor``
  (not below ``r``) whenever the validation loss has not improved on its best by more than
  ``threshold`` (relative) for more than ``patience`` evaluations in a row. Stateful.
"""

from __future__ import annotations

import math
from typing import get_args

from lmforge.config import ScheduleConfig


def warmup_steps(warmup: float, total: int) -> int:
    """``warmup`` as a step count: a fraction of ``total`` when below 1, else the count itself."""
    return round(warmup * total) if 0 < warmup < 1 else int(warmup)


def warmup_factor(step: int, warmup: int) -> float | None:
    """``(step + 1) / warmup`` during warmup, else None."""
    return (step + 1) / warmup if step < warmup else None


def progress(step: int, warmup: int, total: int) -> float:
    """``(step - warmup) / (total - warmup)`` clamped to [0, 1]."""
    return min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))


def cosine_between(high: float, low: float, q: float) -> float:
    """Half a cosine from ``high`` (q = 0) to ``low`` (q = 1)."""
    return low + (high - low) * 0.5 * (1.0 + math.cos(math.pi * q))


def _decayed(cfg: ScheduleConfig, s: int, total: int, w: int) -> float:
    r, p = cfg.min_lr_ratio, progress(s, w, total)
    name = cfg.name
    if name == "constant":
        return 1.0
    if name == "linear":
        return 1.0 - (1.0 - r) * p
    if name == "cosine":
        return cosine_between(1.0, r, p)
    if name == "wsd":
        start = total - round(cfg.wsd.decay_fraction * total)
        if s < start:
            return 1.0
        q = min(1.0, (s - start) / max(1, total - start))
        if cfg.wsd.decay_shape == "linear":
            return 1.0 - (1.0 - r) * q
        if cfg.wsd.decay_shape == "cosine":
            return cosine_between(1.0, r, q)
        return 1.0 - (1.0 - r) * math.sqrt(q)
    if name == "step":
        return max(r, cfg.step.gamma ** ((s - w) // cfg.step.step_size))
    if name == "polynomial":
        return r + (1.0 - r) * (1.0 - p) ** cfg.polynomial.power
    if name == "exponential":
        return r**p
    if name == "inverse_sqrt":
        scale = max(w, 1)
        return math.sqrt(scale / max(s + 1, scale))
    if name == "cyclic":
        half = cfg.cyclic.cycle_steps / 2
        phase = ((s - w) % cfg.cyclic.cycle_steps) / half
        return r + (1.0 - r) * (1.0 - abs(phase - 1.0))
    raise ValueError(f"schedule.name: {name} is not a pure schedule")


def lr_multiplier(cfg: ScheduleConfig, step: int, total: int) -> float:
    """Multiplier of the peak learning rate at ``step`` of ``total`` for every pure schedule."""
    w = warmup_steps(cfg.warmup, total)
    if cfg.name == "one_cycle":
        a = 1.0 / cfg.one_cycle.div_factor
        if step < w:
            return a + (1.0 - a) * 0.5 * (1.0 - math.cos(math.pi * step / w))
        return cosine_between(1.0, cfg.min_lr_ratio, progress(step, w, total))
    f = warmup_factor(step, w)
    return f if f is not None else _decayed(cfg, step, total, w)


def lr_curve(cfg: ScheduleConfig, peak: float, total: int) -> list[float]:
    """``peak * m(s)`` for ``s = 0 .. total - 1``, through :class:`Schedule` (``plateau``: as if the
    validation loss kept improving, so warmup then flat)."""
    schedule = Schedule(cfg, total)
    return [peak * schedule(s) for s in range(total)]


class Schedule:
    """The schedule of a run: ``schedule(step)`` gives the multiplier; ``observe(val_loss)`` feeds
    ``plateau``. ``state_dict`` holds the plateau state (pure schedules have none beyond the step)."""

    def __init__(self, cfg: ScheduleConfig, total: int):
        self.cfg, self.total = cfg, total
        self.factor, self.best, self.bad = 1.0, math.inf, 0

    def __call__(self, step: int) -> float:
        if self.cfg.name != "plateau":
            return lr_multiplier(self.cfg, step, self.total)
        f = warmup_factor(step, warmup_steps(self.cfg.warmup, self.total))
        return f if f is not None else self.factor

    def observe(self, val_loss: float) -> None:
        if self.cfg.name != "plateau" or not math.isfinite(val_loss):
            return
        if val_loss < self.best * (1.0 - self.cfg.plateau.threshold):
            self.best, self.bad = val_loss, 0
            return
        self.bad += 1
        if self.bad > self.cfg.plateau.patience:
            self.factor = max(self.cfg.min_lr_ratio, self.factor * self.cfg.plateau.factor)
            self.bad = 0

    def state_dict(self) -> dict:
        return {"factor": self.factor, "best": self.best, "bad": self.bad}

    def load_state_dict(self, state: dict) -> None:
        self.factor, self.best, self.bad = state["factor"], state["best"], state["bad"]


SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleConfig.model_fields["name"].annotation)
