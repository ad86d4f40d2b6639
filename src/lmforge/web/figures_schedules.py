"""The LR-schedules page's figures: every lmforge schedule evaluated by lmforge's own
:class:`lmforge.optim.schedules.Schedule` (which calls ``lr_multiplier``) for a :class:`ScheduleConfig`
built from the page's controls. ``lr(s) = peak * m(s)``, ``m`` as in ``lmforge/optim/schedules.py``.

The seed tool's four curves are lmforge schedules with settings: ``constant``, ``linear`` (linear decay)
and ``cosine`` with ``warmup = 0``, and ``warmup + linear`` = ``linear`` with the page's warmup. Every
other curve is the schedule of that name with the page's warmup and its own sub-table.

``plateau`` reacts to validation losses, which a planner does not have: the page feeds it an assumed
series, fed as the trainer's evaluation callback does (after step count ``c``, a multiple of
``eval_interval`` below ``T``, ``observe(loss)``; steps ``>= c`` see the new factor): the loss falls 1%
per evaluation (``loss_k = 0.99^k``) until step ``plateau_stall``, then stays flat, so the cuts of
``patience`` / ``factor`` after the stall are visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lmforge.config import ScheduleConfig
from lmforge.errors import UserError
from lmforge.optim.schedules import SCHEDULE_NAMES, Schedule, warmup_steps

MAX_POINTS = 1000  # about this many evenly spaced steps per curve, plus the boundaries


@dataclass(frozen=True)
class Series:
    """One curve of the page: its key (the checkbox name), label, lmforge schedule name, and whether it
    uses the page's warmup (the seed's constant / linear decay / cosine have none)."""

    key: str
    label: str
    name: str
    warmup: bool


SERIES: tuple[Series, ...] = (
    Series("constant", "constant", "constant", False),
    Series("linear", "linear decay", "linear", False),
    Series("cosine", "cosine", "cosine", False),
    Series("warmup_linear", "warmup + linear", "linear", True),
    Series("warmup_cosine", "warmup + cosine (lmforge's default)", "cosine", True),
    *(Series(n, n, n, True) for n in SCHEDULE_NAMES if n not in ("constant", "linear", "cosine")),
)
SEED_SERIES = ("constant", "linear", "cosine", "warmup_linear")
SERIES_BY_KEY = {s.key: s for s in SERIES}


def schedule_config(
    series: Series, warmup: float, min_lr_ratio: float, sub: dict[str, dict]
) -> ScheduleConfig:
    """The :class:`ScheduleConfig` of ``series``: its name, the warmup (0 for the seed's no-warmup curves),
    ``min_lr_ratio`` and the sub-tables ``sub`` (``{"wsd": {...}, "step": {...}, ...}``). A value lmforge
    refuses is a one-line UserError naming the ``schedule.*`` key."""
    try:
        return ScheduleConfig(
            name=series.name, warmup=warmup if series.warmup else 0, min_lr_ratio=min_lr_ratio, **sub
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = f"schedule.{'.'.join(str(x) for x in err['loc'])}: " if err["loc"] else ""
        raise UserError(f"{series.label}: {where}{msg}") from None


def sample_steps(total: int, boundaries: list[int], max_points: int = MAX_POINTS) -> list[int]:
    """Steps where the curves are evaluated: every ``k = ceil(total / max_points)``-th step from 0, the last
    step ``total - 1``, and each boundary ``b`` with ``b - 1`` (a jump is drawn where it happens)."""
    k = max(1, -(-total // max_points))
    steps = set(range(0, total, k)) | {total - 1}
    for b in boundaries:
        steps |= {s for s in (b - 1, b) if 0 <= s < total}
    return sorted(steps)


def assumed_val_loss(count: int, interval: int, stall: int) -> float:
    """The validation loss fed to ``plateau`` after ``count`` steps: ``0.99^k`` with
    ``k = min(count, stall) // interval`` evaluations of improvement."""
    return 0.99 ** (min(count, stall) // interval)


def curve(cfg: ScheduleConfig, total: int, steps: list[int], eval_interval: int, stall: int) -> list[float]:
    """``m(s)`` of :class:`Schedule` at each of the sorted ``steps``; ``plateau`` observes the assumed
    validation losses in step order, as the trainer does (see the module docstring)."""
    schedule = Schedule(cfg, total)
    out = []
    count = 0  # steps done: evaluations happen at counts that are multiples of eval_interval
    for s in steps:
        if cfg.name == "plateau" and eval_interval:
            while count < s:
                count += 1
                if count % eval_interval == 0 and count < total:
                    schedule.observe(assumed_val_loss(count, eval_interval, stall))
        out.append(schedule(s))
    return out


def schedules_figures(
    peak_lr: float,
    total: int,
    warmup: float,
    min_lr_ratio: float,
    selected: list[str],
    sub: dict[str, dict],
    probes: list[int],
    eval_interval: int = 250,
    plateau_stall: int = 5000,
) -> dict[str, Any]:
    """Every selected series as ``{key, label, name, config, x, lr}`` with ``lr = peak_lr * m(s)`` at the
    sampled steps, the exact ``lr`` at each probe step (0, ``W - 1``, ``W``, ``T - 1`` and ``probes``), and the warmup region ``[0, W)`` in steps."""
    w = warmup_steps(warmup, total)
    configs = {key: schedule_config(SERIES_BY_KEY[key], warmup, min_lr_ratio, sub) for key in selected}
    bounds = [w]
    if "wsd" in configs:
        bounds.append(total - round(configs["wsd"].wsd.decay_fraction * total))
    x = sample_steps(total, bounds)
    probes = sorted({p for p in (0, w - 1, w, total - 1, *probes) if 0 <= p < total})
    series = []
    for key, cfg in configs.items():
        s = SERIES_BY_KEY[key]
        m = curve(cfg, total, x, eval_interval, plateau_stall)
        at = curve(cfg, total, probes, eval_interval, plateau_stall)
        series.append(
            {
                "key": key,
                "label": s.label,
                "name": s.name,
                "config": cfg.model_dump(),
                "warmup_steps": warmup_steps(cfg.warmup, total),
                "x": x,
                "lr": [peak_lr * v for v in m],
                "probes": {str(p): peak_lr * v for p, v in zip(probes, at, strict=True)},
            }
        )
    return {"total": total, "warmup_steps": w, "peak_lr": peak_lr, "probes": probes, "series": series}
