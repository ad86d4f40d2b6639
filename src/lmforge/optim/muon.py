"""Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks") for hidden
matrices, with AdamW for every other parameter, as one optimizer.

Per hidden weight matrix ``W`` of shape ``(d_out, d_in)`` with gradient ``G``, momentum ``mu``, rate ``lr``
and decoupled weight decay ``wd``::

    B = mu * B + (1 - mu) * G                     # momentum buffer (the only state)
    U = (1 - mu) * G + mu * B   if nesterov else B
    O = NS_k(U)                                   # k quintic Newton-Schulz steps, in BF16 (~ U V^T)
    W = W * (1 - lr * wd) - lr * s(d_out, d_in) * O

with the update scale ``s``:

    none       1
    original   max(1, d_out / d_in) ^ 0.5         (Jordan's reference; torch "original")
    mup        (d_out / d_in) ^ 0.5               (muP's spectral condition)
    moonlight  0.2 * max(d_out, d_in) ^ 0.5       (Liu et al. 2025, "Muon is Scalable for LLM Training":
                                                   gives the update AdamW's RMS, so AdamW's lr applies)

``torch.optim.Muon`` (torch 2.13) implements this algorithm with the ``original`` and ``moonlight``
(``match_rms_adamw``) scales; :class:`Muon` uses its ``step`` unchanged for those. torch offers no
``none`` or ``mup`` scale and no way to add one, so for these two :class:`Muon` runs its own step, which
is the same loop with the other scale (tests check it equals torch's bitwise where the scales agree).

Sharded parameters (``DTensor``: FSDP2, tensor parallelism) also take that loop, whatever the scale:
the momentum buffer stays sharded like the parameter, the update is gathered whole for Newton-Schulz
(which needs the whole matrix) and each rank keeps its own part of the result (``lmforge/optim/sharded``),
so the step equals a single process's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lmforge.optim.closure import run_closure
from lmforge.optim.sharded import full, is_sharded, shard_like

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
SCALES = ("none", "original", "mup", "moonlight")
_TORCH_SCALE = {"original": "original", "moonlight": "match_rms_adamw"}


def newton_schulz(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of ``g = U S V^T`` by quintic Newton-Schulz, in BF16.

    ``X_0 = g / max(||g||_F, eps)`` (transposed so that rows <= columns), then ``steps`` times::

        A = X X^T
        X = a X + (b A + c A^2) X          (a, b, c) = (3.4445, -4.7750, 2.0315)

    which maps each singular value ``x`` of ``X`` to ``a x + b x^3 + c x^5``: the coefficients make the
    slope at 0 steep, so after 5 steps singular values not too close to 0 lie roughly in [0.7, 1.2]
    rather than at exactly 1 (measured on Gaussian rectangular matrices: [0.68, 1.16]).
    The arithmetic (BF16, ``addmm`` fusions) is that of ``torch.optim.Muon``.
    """
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def update_scale(shape: torch.Size | tuple[int, ...], scale: str) -> float:
    """The multiplier ``s(d_out, d_in)`` of the orthogonalised update (see the module docstring)."""
    d_out, d_in = shape[0], shape[1]
    if scale == "none":
        return 1.0
    if scale == "original":
        return math.sqrt(max(1, d_out / d_in))
    if scale == "mup":
        return math.sqrt(d_out / d_in)
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(d_out, d_in))
    raise ValueError(f"Muon: unknown scale {scale!r}; one of {', '.join(SCALES)}")


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with the update scale chosen by name (``none``, ``original``, ``mup``,
    ``moonlight``); torch's own step serves ``original`` and ``moonlight`` unless parameters are sharded."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scale: str = "original",
    ):
        if scale not in SCALES:
            raise ValueError(f"Muon: unknown scale {scale!r}; one of {', '.join(SCALES)}")
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=NS_COEFFICIENTS,
            ns_steps=ns_steps,
            adjust_lr_fn=_TORCH_SCALE.get(scale),
        )
        self.scale = scale

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        sharded = any(is_sharded(p) for g in self.param_groups for p in g["params"])
        if self.scale in _TORCH_SCALE and not sharded:
            return super().step(closure)
        loss = run_closure(closure)
        for group in self.param_groups:
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(full(update), group["ns_steps"], group["ns_coefficients"], group["eps"])
                ortho = shard_like(ortho, p)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-lr * update_scale(p.shape, self.scale))
                del update, ortho  # else they live on through the next matrix's Newton-Schulz
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: :class:`Muon` for the groups marked ``optimizer="muon"``, fused
    ``torch.optim.AdamW`` for those marked ``"adamw"``.

    ``param_groups`` lists the inner optimizers' group dicts themselves (in the given order) and ``state`` is
    shared with both, so the training loop's per-group ``lr`` (``lr * lr_mult``), ``zero_grad`` and the
    standard ``state_dict`` / ``load_state_dict`` work as for any single ``torch.optim.Optimizer``.
    """

    def __init__(
        self,
        groups: list[dict],
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scale: str = "original",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused: bool | None = None,
    ):
        muon = [g for g in groups if g["optimizer"] == "muon"]
        adamw = [g for g in groups if g["optimizer"] == "adamw"]
        if len(muon) + len(adamw) != len(groups):
            raise ValueError("MuonWithAdamW: every group needs optimizer='muon' or 'adamw'")
        self._parts: list[tuple[str, torch.optim.Optimizer]] = []
        if muon:
            self._parts.append(
                ("muon", Muon(muon, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, scale=scale))
            )
        if adamw:
            self._parts.append(("adamw", torch.optim.AdamW(adamw, betas=betas, eps=eps, fused=fused)))
        # the inner optimizers' group dicts (with their defaults filled in), in the order given: a wrapper
        # that pairs groups by position (ZeRO-1) sees them where it put them
        made = {route: iter(part.param_groups) for route, part in self._parts}
        super().__init__([next(made[g["optimizer"]]) for g in groups], {})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's group dicts and state (after init and load)."""
        for route, part in self._parts:
            part.param_groups = [g for g in self.param_groups if g["optimizer"] == route]
            part.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = run_closure(closure)
        for _, part in self._parts:
            part.step()
        return loss
