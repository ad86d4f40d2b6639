"""Gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_global_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / ||g||_2)`` where ``||g||`` is the global L2 norm.

    Returns the pre-clip global norm. ``max_norm = 0`` only measures.
    """
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
