"""The balance rules of an MoE layer as pure functions (formulas in each docstring).

The Switch/GShard loss (:func:`switch_aux_loss`), DeepSeek-V3's sequence-wise loss
(:func:`sequence_aux_loss`), the router z-loss (:func:`router_z_loss`), the router's entropy and the
load's imbalance (metrics), and auxiliary-loss-free balancing (:func:`update_bias`, run after each
optimizer step by ``model/moe.py::register_balance_step``). Each is computed in its inputs' dtype, at
least FP32.
"""

from __future__ import annotations

import torch

from lmforge.model.moe_routing import accumulation_dtype, expert_counts


def switch_aux_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer / GShard load-balancing loss over a micro-batch's ``T`` tokens:
    ``L = E * sum_i f_i P_i`` with ``f_i = (assignments to i) / (T k)`` (not differentiable) and
    ``P_i = mean_t p_t,i`` (``probs``: :func:`score_distribution`, ``(T, E)``). 1 when both are uniform."""
    t, k = experts.shape
    f = expert_counts(experts, n_experts) / (t * k)
    return n_experts * (f * probs.mean(0)).sum()


def sequence_aux_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the ``B`` sequences: per sequence of ``S``
    tokens ``L = sum_i f_i P_i`` with ``f_i = E / (k S) * (assignments to i in the sequence)`` and
    ``P_i = mean_t p_t,i`` over the sequence (``probs`` ``(B, S, E)``, ``experts`` ``(B, S, k)``)."""
    b, s, k = experts.shape
    like = dict(dtype=probs.dtype, device=experts.device)
    counts = torch.zeros(b, n_experts, **like).scatter_add_(
        1, experts.reshape(b, -1), torch.ones(b, s * k, **like)
    )
    f = counts * n_experts / (k * s)
    return (f * probs.mean(1)).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean_t (log sum_i exp z_t,i)^2`` (keeps the router logits small)."""
    return torch.logsumexp(logits.to(accumulation_dtype(logits.dtype)), -1).square().mean()


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``-sum_i p_i log p_i`` (nats; ``log E`` at most)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """``max_i load_i / mean_i load_i`` (1: perfectly balanced, ``E``: one expert takes all)."""
    return load.max() / load.mean().clamp_min(1e-30)


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): ``b_i += u * sign(mean_j load_j - load_i)``, in
    place: an overloaded expert's bias falls, an underloaded one's rises."""
    bias.add_(rate * torch.sign(load.mean() - load))
