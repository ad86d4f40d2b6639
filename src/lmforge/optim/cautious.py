"""Cautious weight decay (Chen et al. 2025, "Cautious Weight Decay", arXiv 2510.12402).

Decoupled weight decay moves every coordinate toward zero: ``x_{t+1} = x_t - lr (u_t + wd x_t)``, where
``u_t`` is the optimizer's update (AdamW: ``m_hat / (sqrt(v_hat) + eps)``; Lion: the sign of the
interpolated momentum; Muon: the orthogonalised momentum). Cautious decay keeps it only where the update
already moves the coordinate toward zero, i.e. where ``u_t`` and ``x_t`` have the same sign:

    x_{t+1} = x_t - lr (u_t + wd * 1[u_t * x_t >= 0] * x_t)

(the paper's rule, with the indicator of a non-negative product; it adds no hyperparameter).

lmforge applies it around any optimizer with decoupled decay (``adamw``, ``lion``, ``adafactor``,
``adamw8bit``, ``muon``, ``soap``; ``adam`` and ``sgd`` add decay to the gradient and are refused by the config):
groups with ``optim.cautious_weight_decay`` carry their decay as ``cautious_weight_decay`` and
``weight_decay = 0``, so the optimizer's own step computes ``x' = x_t - lr u_t``; a step pre-hook keeps
``x_t``, a post-hook reads ``lr u_t = x_t - x'`` and subtracts ``lr wd 1[(x_t - x') x_t >= 0] x_t``. An
update smaller than the last bit of ``x_t`` reads as ``u_t = 0`` and the coordinate is decayed, as
plain decay would. Memory: a copy of the decayed parameters (this rank's shards) during the step.

The mask is element-wise, so it is computed on each rank's own values: DDP and ZeRO-1 (after the
broadcast, every rank holds the same parameters), FSDP2 and tensor parallelism (each rank its shard) all
match one process, with no communication.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def cautious_decay_(
    after: torch.Tensor, before: torch.Tensor, lr: float, wd: float, scale: torch.Tensor | float = 1.0
) -> None:
    """``after <- after - lr * wd * scale * 1[(before - after) * before >= 0] * before`` in place, where
    ``after = before - lr u`` is the parameter after an undecayed step (``scale``: 0 where the step was
    skipped, e.g. a fused kernel's ``found_inf``)."""
    a, b = _local(after), _local(before)
    mask = ((b - a) * b >= 0).to(b.dtype)
    a.sub_(b * mask * scale, alpha=lr * wd)


class CautiousDecay:
    """The hooks that apply cautious decay to the groups holding ``cautious_weight_decay`` (see above)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.before: list[list[torch.Tensor]] = []
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def _groups(self) -> list[dict]:
        return [g for g in self.optimizer.param_groups if g.get("cautious_weight_decay", 0.0) > 0]

    def _pre(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            self.before = [[_local(p).detach().clone() for p in g["params"]] for g in self._groups()]

    def _post(self, optimizer, args, kwargs) -> None:
        found_inf = getattr(optimizer, "found_inf", None)  # a scaler's fused step that skipped itself
        scale = 1.0 if found_inf is None else 1.0 - found_inf.float()
        with torch.no_grad():
            for group, before in zip(self._groups(), self.before, strict=True):
                for p, b in zip(group["params"], before, strict=True):
                    if p.grad is not None:
                        cautious_decay_(p, b, group["lr"], group["cautious_weight_decay"], scale)
        self.before = []


def register_cautious_decay(optimizer: torch.optim.Optimizer) -> CautiousDecay | None:
    """Install cautious decay on ``optimizer`` when one of its groups asks for it (else None)."""
    if not any(g.get("cautious_weight_decay", 0.0) > 0 for g in optimizer.param_groups):
        return None
    return CautiousDecay(optimizer)
