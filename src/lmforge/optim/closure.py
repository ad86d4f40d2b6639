"""The closure convention of ``torch.optim``: a step may be given a function that recomputes the loss."""

from __future__ import annotations

from collections.abc import Callable

import torch


def run_closure(closure: Callable[[], float] | None) -> float | None:
    """``closure()`` with gradients enabled (steps run under ``no_grad``), or None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
