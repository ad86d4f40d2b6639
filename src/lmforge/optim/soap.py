"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", arXiv 2409.11321): Adam
run in the eigenbasis of Shampoo's preconditioner.

Per weight matrix ``W`` of shape ``(m, n)`` with gradient ``G`` at step ``t`` (1, 2, ...), betas
``(b1, b2)``, the factors' beta ``bs``, rate ``lr``, decoupled weight decay ``wd``, refresh interval ``f``::

    L = bs * L + (1 - bs) * G G^T                       # Shampoo's left factor   (m x m)
    R = bs * R + (1 - bs) * G^T G                       # Shampoo's right factor  (n x n)
    if t == 1:            QL, QR = eigenvectors of L, R  (eigh, columns by decreasing eigenvalue)
    elif (t - 1) % f == 0:                               # refresh: one step of subspace iteration
        order = argsort(diag(Q^T F Q), descending)       # per side, F its factor: re-sort the columns
        Q = Q[:, order];  V = V permuted alike           # (V's rows for the left side, columns for the right)
        Q, _ = QR(F Q)
    M = b1 * M + (1 - b1) * G                           # first moment, in the original coordinates
    G' = QL^T G QR                                      # the gradient rotated into the eigenbasis
    V = b2 * V + (1 - b2) * G' * G'                     # second moment, in the eigenbasis
    N' = (QL^T M QR / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps)     # Adam's step, in the eigenbasis
    W = W * (1 - lr * wd) - lr * QL N' QR^T             # rotated back

A side whose dimension exceeds ``max_precond_dim`` keeps no factor and is not rotated (its ``Q`` is the
identity: one-sided SOAP); a matrix with both sides over it, and every parameter that is not 2-D
(norms, biases, 3-D expert weights), takes plain AdamW: ``M``, ``V`` and the last two lines with ``Q = I``.
State per matrix: ``step``, ``exp_avg`` (``M``), ``exp_avg_sq`` (``V``), and per preconditioned side its
factor and basis (``L``, ``QL``; ``R``, ``QR``): ``8mn + 8(m^2 + n^2)`` bytes in FP32, plus the step.

Where this differs from the paper's reference implementation (choices of lmforge, stated): the first step
already moves the weights (with the basis of ``G_1``; the reference spends it on the factors alone), Adam's
bias correction is torch's (``eps`` added to the corrected root), the factors and bases are kept in the
parameter's dtype (FP32 in lmforge, float64 in the tests), and the factors take ``G_t`` before the basis is
refreshed, so a refresh at ``t`` already sees ``G_t``. Not implemented: merging dimensions of higher-rank
tensors, preconditioning 1-D parameters, gradient normalisation.

Sharded parameters (``DTensor``: FSDP2, tensor parallelism): the rotations need the whole matrix, so each
rank gathers the gradient whole (``lmforge/optim/sharded``), computes ``L``, ``R``, their bases and the
rotations as one process would (those four stay whole on every rank: ``8(m^2 + n^2)`` bytes each rank),
while ``M`` and ``V`` stay sharded like the parameter: ``M`` is updated on the local gradient shard, ``V``
on the rank's part of ``G'``, and ``M`` (to rotate it) and ``N'`` (to rotate it back) are gathered, plus
``V`` at a refresh (to permute it). Three all-gathers of the matrix per step, four at a refresh; the
result equals one process's step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lmforge.optim.closure import run_closure
from lmforge.optim.sharded import full, shard_like

SIDES = (("L", "QL"), ("R", "QR"))


def preconditioned_sides(shape: torch.Size | tuple[int, ...], max_precond_dim: int) -> tuple[bool, bool]:
    """Which sides of a parameter of ``shape`` SOAP rotates: ``(left, right)``; both False for anything
    not 2-D, each False where its dimension exceeds ``max_precond_dim``."""
    if len(shape) != 2:
        return False, False
    return shape[0] <= max_precond_dim, shape[1] <= max_precond_dim


def factor_update(g: torch.Tensor, side: int) -> torch.Tensor:
    """``G G^T`` (``side`` 0, left) or ``G^T G`` (``side`` 1, right)."""
    return g @ g.T if side == 0 else g.T @ g


def eigenbasis(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of the symmetric ``factor``, as columns by decreasing eigenvalue (``eigh``; in float64
    if it fails to converge in the factor's dtype)."""
    try:
        _, q = torch.linalg.eigh(factor)
    except torch.linalg.LinAlgError:
        _, q = torch.linalg.eigh(factor.double())
        q = q.to(factor.dtype)
    return q.flip(1)


def refresh_order(factor: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The column order of a refresh: indices sorting the eigenvalue estimates ``diag(Q^T F Q)`` from the
    largest down (stable, so ties keep their order)."""
    estimates = (q * (factor @ q)).sum(0)
    return torch.argsort(estimates, descending=True, stable=True)


def subspace_step(factor: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """One step of subspace (power) iteration toward ``factor``'s eigenvectors: ``Q`` of ``QR(F Q)``."""
    q_new, _ = torch.linalg.qr(factor @ q)
    return q_new


def rotate(x: torch.Tensor, ql: torch.Tensor | None, qr: torch.Tensor | None) -> torch.Tensor:
    """``QL^T x QR`` (a missing side is the identity)."""
    if ql is not None:
        x = ql.T @ x
    if qr is not None:
        x = x @ qr
    return x


def rotate_back(x: torch.Tensor, ql: torch.Tensor | None, qr: torch.Tensor | None) -> torch.Tensor:
    """``QL x QR^T`` (a missing side is the identity)."""
    if ql is not None:
        x = ql @ x
    if qr is not None:
        x = x @ qr.T
    return x


class SOAP(torch.optim.Optimizer):
    """SOAP over 2-D parameters, AdamW over the rest (see the module docstring).

    ``shampoo_beta`` is the factors' EMA beta (None: ``betas[1]``, as the paper), ``precondition_frequency``
    the steps between basis refreshes, ``max_precond_dim`` the largest dimension given a factor.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        shampoo_beta: float | None = None,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
    ):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps <= 0:
            raise ValueError("SOAP: lr and eps must be > 0 and betas in [0, 1)")
        if precondition_frequency < 1 or max_precond_dim < 1:
            raise ValueError("SOAP: precondition_frequency and max_precond_dim must be >= 1")
        if shampoo_beta is not None and not 0 <= shampoo_beta < 1:
            raise ValueError("SOAP: shampoo_beta must be in [0, 1)")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "shampoo_beta": shampoo_beta,
            "precondition_frequency": precondition_frequency,
            "max_precond_dim": max_precond_dim,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return loss

    def _init_state(self, p: torch.Tensor, sides: tuple[bool, bool]) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for i, (factor, basis) in enumerate(SIDES):
                if sides[i]:
                    d = p.shape[i]
                    dtype, device = p.dtype, p.device
                    state[factor] = torch.zeros(d, d, dtype=dtype, device=device)
                    state[basis] = torch.eye(d, dtype=dtype, device=device)
        return state

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        sides = preconditioned_sides(p.shape, group["max_precond_dim"])
        state = self._init_state(p, sides)
        state["step"] += 1
        t = int(state["step"].item())
        (b1, b2), eps, lr, wd = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        bs = b2 if group["shampoo_beta"] is None else group["shampoo_beta"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        if wd:
            p.mul_(1 - lr * wd)
        m.lerp_(p.grad, 1 - b1)
        if not any(sides):  # AdamW, element-wise (a DTensor's shards as they are)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / bc2).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
            return
        g = full(p.grad)
        for i, (factor, _) in enumerate(SIDES):
            if sides[i]:
                state[factor].lerp_(factor_update(g, i), 1 - bs)
        if t == 1:
            for i, (factor, basis) in enumerate(SIDES):
                if sides[i]:
                    state[basis].copy_(eigenbasis(state[factor]))
        elif (t - 1) % group["precondition_frequency"] == 0:
            whole_v = full(v)
            for i, (factor, basis) in enumerate(SIDES):
                if sides[i]:
                    order = refresh_order(state[factor], state[basis])
                    whole_v = whole_v[order] if i == 0 else whole_v[:, order]
                    state[basis].copy_(subspace_step(state[factor], state[basis][:, order]))
                    del order
            v.copy_(shard_like(whole_v, p))
            del whole_v
        ql, qr = (state[basis] if sides[i] else None for i, (_, basis) in enumerate(SIDES))
        g_rot = shard_like(rotate(g, ql, qr), p)
        v.mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)
        del g, g_rot
        m_rot = shard_like(rotate(full(m), ql, qr), p)
        n_rot = m_rot.div_(bc1).div_((v / bc2).sqrt_().add_(eps))
        update = rotate_back(full(n_rot), ql, qr)
        del m_rot, n_rot
        p.add_(shard_like(update, p), alpha=-lr)
