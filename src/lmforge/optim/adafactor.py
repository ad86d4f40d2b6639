"""Adafactor (Shazeer & Stern 2018) as ``torch.optim.Adafactor``, also over sharded parameters.

torch's Adafactor keeps, per matrix, a row and a column mean of squared gradients and scales each update
by its own RMS and by the parameter's RMS: every one of those statistics spans the whole matrix, and torch
computes them with in-place ops on partial results, which ``DTensor`` refuses. So for a ``DTensor``
parameter (FSDP2, tensor parallelism) this class gathers the parameter and its gradient whole, runs torch's
own functional step on them with whole-matrix state (row and column vectors, and full variances of vectors:
all small, the same on every rank), and keeps this rank's part (see ``lmforge/optim/sharded``). That is
exactly a single process's step, for one all-gather of each parameter and gradient per step. Plain
parameters take torch's step unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim._adafactor import adafactor
from torch.optim.optimizer import _get_scalar_dtype

from lmforge.optim.closure import run_closure
from lmforge.optim.sharded import full, is_sharded, shard_like


class Adafactor(torch.optim.Adafactor):
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not any(is_sharded(p) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        loss = run_closure(closure)
        for group in self.param_groups:
            params, grads, row_vars, col_vars, variances, steps = [], [], [], [], [], []
            self._init_group(
                {**group, "params": [p for p in group["params"] if not is_sharded(p)]},
                params,
                grads,
                row_vars,
                col_vars,
                variances,
                steps,
            )
            self._functional(group, params, grads, row_vars, col_vars, variances, steps)
            for p in group["params"]:
                if is_sharded(p) and p.grad is not None:
                    whole, grad = full(p), full(p.grad)
                    state = self._whole_state(p, grad)
                    self._functional(
                        group,
                        [whole],
                        [grad],
                        [state.get("row_var")],
                        [state.get("col_var")],
                        [state.get("variance")],
                        [state["step"]],
                    )
                    p.copy_(shard_like(whole, p))
                    del whole, grad  # else both live on while the next parameter's are gathered
        return loss

    def _whole_state(self, p: torch.Tensor, grad: torch.Tensor) -> dict:
        """The state of sharded ``p``, made as torch makes it for a plain one, shaped like the whole ``grad``."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            if grad.dim() > 1:
                state["row_var"] = grad.new_zeros((*grad.shape[:-1], 1))
                state["col_var"] = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _functional(
        group: dict, params: list, grads: list, row_vars: list, col_vars: list, variances: list, steps: list
    ) -> None:
        """torch's functional Adafactor step with ``group``'s settings."""
        if not params:
            return
        eps1, eps2 = group["eps"]
        adafactor(
            params,
            grads,
            row_vars,
            col_vars,
            variances,
            steps,
            foreach=group["foreach"],
            d=group["d"],
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            weight_decay=group["weight_decay"],
            eps1=eps1,
            eps2=eps2,
            maximize=group["maximize"],
        )
