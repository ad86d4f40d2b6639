"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

Per parameter, with gradient ``g``, momentum ``m`` (the only state), betas ``(b1, b2)``, rate ``lr`` and
decoupled weight decay ``wd``::

    c = b1 * m + (1 - b1) * g            # interpolation used for the update
    p = p * (1 - lr * wd) - lr * sign(c)
    m = b2 * m + (1 - b2) * g            # momentum tracked with the slower beta

torch ships no Lion; this is a direct implementation with ``torch._foreach`` kernels, one parameter group
at a time: the step's only scratch is ``c`` for the group being stepped, one FP32 copy of its values
(``plan/memory.py::optimizer_step_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lmforge.optim.closure import run_closure


class Lion(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        if lr <= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError("Lion: lr must be > 0 and betas in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            moms = [self.state[p]["exp_avg"] for p in params]
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            update = torch._foreach_mul(moms, b1)
            torch._foreach_add_(update, grads, alpha=1.0 - b1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_mul_(moms, b2)
            torch._foreach_add_(moms, grads, alpha=1.0 - b2)
            del update  # else it lives on while the next group's is made: two groups' copies at once
        return loss
