"""Gradient clipping: by global norm, by value, per parameter group, or against an adaptive threshold.

Notation: ``g`` all gradients, ``n = ||g||_2`` their global L2 norm before clipping, ``c`` the threshold.
Every mode first measures ``n`` (:meth:`Clipper.measure`, one fused ``foreach`` norm and no host sync),
so the caller can check it for NaN/Inf before anything is changed, then clips (:meth:`Clipper.clip`):

* ``norm``:       ``g <- g * min(1, c / (n + 1e-6))`` with ``c = train.grad_clip`` (0: no clipping).
* ``value``:      ``g_i <- clamp(g_i, -v, v)`` elementwise, ``v = train.value_clip.limit``.
* ``group_norm``: per optimizer parameter group ``k`` with norm ``n_k``:
  ``g_k <- g_k * min(1, c / (n_k + 1e-6))``, ``c = train.grad_clip``; the global ``n = sqrt(sum_k n_k^2)``.
* ``adaptive``:   ``norm`` clipping with ``c_t = f * m_t / (1 - beta^t)`` (``f = train.adaptive_clip.factor``,
  ``beta = train.adaptive_clip.beta``), the bias-corrected exponential moving average of the norms of the ``t``
  steps clipped so far, each entering the average after its own clipping:
  ``m_{t+1} = beta * m_t + (1 - beta) * min(n_t, c_t)``, ``m_0 = 0``. Until ``t = train.adaptive_clip.warmup``
  the threshold is ``train.grad_clip`` (0: none). Feeding the clipped norm keeps one outlier from
  raising the threshold that is meant to catch the next one. State: ``m`` and ``t`` (``state_dict``).

Under pipeline parallelism ``n`` adds the squares of every stage's gradients (``Clipper.across``) and
counts a tied embedding matrix held by two stages once (``Clipper.copies``: the head's copy is left out),
so it is the one-process norm.

:meth:`Clipper.clip` returns :class:`ClipStats`: the clip ratio ``||g_after|| / ||g_before||`` (1: not
clipped; below 1: the gradient was shortened to that fraction) as a tensor, so taking it costs no sync,
and the norm threshold applied.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.config import TrainConfig

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_global_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale all gradients by ``min(1, max_norm / (||g||_2 + 1e-6))`` where ``||g||`` is the global L2 norm.

    Returns the pre-clip global norm. ``max_norm = 0`` only measures.
    """
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)


def _grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def by_mesh(tensors: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """``tensors`` by the device mesh of a DTensor (None: plain tensors): one fused ``foreach`` op takes
    DTensors of one mesh only (expert-parallel experts live on another mesh than FSDP2's shards)."""
    out: dict[object, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        out[t.device_mesh if isinstance(t, DTensor) else None].append(t)
    return out if out else {None: []}


def _mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """``||g||_2`` of tensors on one mesh, their shards counted once over it (``full_tensor``)."""
    norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def total_norm(grads: list[torch.Tensor], across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``sqrt(sum_i g_i^2)`` over all tensors (0 when there are none), over every process that holds a part.

    Sharded gradients (DTensors: FSDP2, tensor parallelism) count their shards on all ranks of their
    mesh once (``full_tensor`` of the norm); ``across`` adds the squares of other processes holding
    *different* tensors (the pipeline stages): ``n = sqrt(sum_r n_r^2)``.
    """
    norms = [_mesh_norm(same) for same in by_mesh(grads).values()]
    norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    if across is not None:
        squared = norm.to(torch.promote_types(norm.dtype, torch.float32)) ** 2
        dist.all_reduce(squared, group=across)
        norm = squared.sqrt()
    return norm


def norm_coefficient(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``: the factor norm clipping multiplies gradients by."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


def scale_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """``g <- coef * g`` in place, one fused multiply per device (and DTensor mesh).

    ``torch.nn.utils.clip_grads_with_norm_`` does the same but turns its threshold into a Python float
    (a host sync for the adaptive threshold, which is a tensor) and does not return the coefficient.
    """
    by_device: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device, g.device_mesh if isinstance(g, DTensor) else None].append(g)
    for (device, _), same in by_device.items():
        torch._foreach_mul_(same, coef.to(device))


class ClipStats(NamedTuple):
    ratio: torch.Tensor  # ||g_after|| / ||g_before|| (1: not clipped)
    threshold: torch.Tensor | float | None  # the norm threshold applied (None: value mode, or no clipping)


class Clipper:
    """Gradient clipping as configured by ``train.clip_mode`` (formulas in the module docstring).

    ``groups`` are the optimizer's parameter groups, each a list of parameters.
    """

    def __init__(
        self,
        mode: str = "norm",
        max_norm: float = 1.0,
        value: float = 0.0,
        factor: float = 2.0,
        beta: float = 0.98,
        warmup: int = 20,
    ):
        if mode not in ("norm", "value", "group_norm", "adaptive"):
            raise ValueError(f"train.clip_mode: unknown mode {mode!r}")
        if mode == "value" and value <= 0:
            raise ValueError("train.value_clip.limit: clip_mode 'value' needs a limit above 0")
        if mode == "adaptive" and warmup < 1:
            raise ValueError("train.adaptive_clip.warmup: clip_mode 'adaptive' needs at least 1 warmup step")
        self.mode, self.max_norm, self.value = mode, max_norm, value
        self.factor, self.beta, self.warmup = factor, beta, warmup
        self.ema = torch.zeros(())  # m_t (adaptive), kept on the gradients' device
        self.count = 0  # t (adaptive)
        self.across: dist.ProcessGroup | None = None  # processes holding other parameters (pipeline stages)
        # ids of parameters whose gradient is a copy of one counted elsewhere (a pipeline's tied output
        # head, ``parallel/tied_embedding.py``): left out of the norm so the matrix counts once; clipped
        self.copies: frozenset[int] = frozenset()

    @classmethod
    def from_config(cls, t: TrainConfig) -> Clipper:
        a = t.adaptive_clip
        return cls(t.clip_mode, t.grad_clip, t.value_clip.limit, a.factor, a.beta, a.warmup)

    def _counted(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of ``params`` that count towards the norm (not :attr:`copies`)."""
        return _grads(p for p in params if id(p) not in self.copies)

    def measure(self, groups: Sequence[Iterable[torch.Tensor]]) -> torch.Tensor:
        """The pre-clip global gradient norm ``n`` (one fused norm; no host sync)."""
        return total_norm(self._counted(p for group in groups for p in group), self.across)

    def threshold(self) -> torch.Tensor | float | None:
        """The norm threshold ``c`` the next :meth:`clip` applies (None: no norm threshold)."""
        if self.mode == "value":
            return None
        if self.mode == "adaptive" and self.count >= self.warmup:
            return self.factor * self.ema / (1.0 - self.beta**self.count)
        return self.max_norm if self.max_norm > 0 else None

    def clip(self, groups: Sequence[Iterable[torch.Tensor]], norm: torch.Tensor) -> ClipStats:
        """Clip the gradients in place given their pre-clip global norm ``norm``."""
        groups = [list(group) for group in groups]
        one = torch.ones((), device=norm.device)
        if self.mode == "value":
            return self._clip_value(groups, norm, one)
        if self.mode == "group_norm":
            return self._clip_groups(groups, one)
        return self._clip_norm(_grads(p for group in groups for p in group), norm, one)

    def _clip_value(
        self, groups: list[list[torch.Tensor]], norm: torch.Tensor, one: torch.Tensor
    ) -> ClipStats:
        params = [p for group in groups for p in group]
        for same in by_mesh(params).values():
            torch.nn.utils.clip_grad_value_(same, self.value, foreach=True)
        after = total_norm(self._counted(params), self.across)
        return ClipStats(torch.where(norm > 0, after / norm, one), None)

    def _clip_groups(self, groups: list[list[torch.Tensor]], one: torch.Tensor) -> ClipStats:
        before, after = [], []
        for grads in filter(None, (_grads(group) for group in groups)):
            n_k = total_norm(grads).to(one.device)
            coef = one
            if self.max_norm:
                coef = norm_coefficient(n_k, self.max_norm)
                scale_(grads, coef)
            before.append(n_k)
            after.append(n_k * coef)
        if not before:
            return ClipStats(one, None)
        before_n, after_n = (torch.linalg.vector_norm(torch.stack(x)) for x in (before, after))
        return ClipStats(torch.where(before_n > 0, after_n / before_n, one), self.max_norm or None)

    def _clip_norm(self, grads: list[torch.Tensor], norm: torch.Tensor, one: torch.Tensor) -> ClipStats:
        self.ema = self.ema.to(norm.device)
        c = self.threshold()
        coef = one if c is None else norm_coefficient(norm, c)
        if c is not None:
            scale_(grads, coef)
        if self.mode == "adaptive":  # a non-finite norm (guard off) must not poison the average
            seen = torch.where(torch.isfinite(norm), norm * coef, self.ema)
            self.ema = self.beta * self.ema + (1.0 - self.beta) * seen.detach()
            self.count += 1
        return ClipStats(coef, c)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "ema": self.ema.detach().cpu().clone(), "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.mode:  # another mode's statistics mean nothing here
            return
        self.ema, self.count = state["ema"].clone(), int(state["count"])
