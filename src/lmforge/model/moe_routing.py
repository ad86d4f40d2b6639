"""Token-choice routing of an MoE layer as pure functions: scores, the top-k choice, capacity, and the
dispatch of a micro-batch's rows to the experts and the combination of their outputs.

For the ``T`` tokens of a micro-batch the router (an ordinary ``nn.Linear``, ``model/moe.py``) gives
logits ``z``; :func:`router_scores` makes them ``s = softmax(z)`` or ``s = sigmoid(z)``; :func:`route`
picks each token's ``k`` experts by ``topk(s + b)`` (``b``: the balancing bias, which only chooses) and
weighs them by ``s`` (divided by the chosen scores' sum with ``normalize``). With a capacity
(:func:`expert_capacity`, :func:`keep_mask`) an expert takes at most ``C`` assignments; :func:`dispatch`
orders the kept assignments by expert for the grouped matrix products and :func:`combine` adds each
token's weighted expert outputs back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing and the combination compute in: FP32, or FP64 for a float64 model
    (``train.precision = "fp64"``, where layouts are compared with one process)."""
    return torch.promote_types(dtype, torch.float32)


def module_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (a QLoRA layer's adapters where its base
    weight is NF4 buffers); ``default`` if it has none."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return default


def router_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``z = router(x)`` through the router module's own forward (so LoRA, QLoRA and QAT, which replace
    the module, run), outside autocast, in the router's parameter dtype (FP32 master weights in one
    process and DDP, FP64 under fp64, the gathered BF16 under FSDP2's mixed precision), returned in
    :func:`accumulation_dtype`."""
    acc = accumulation_dtype(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return router(x.to(module_dtype(router, acc))).to(acc)


def router_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """``softmax(z)`` over the experts or ``sigmoid(z)`` per expert, in FP32 at least."""
    logits = logits.to(accumulation_dtype(logits.dtype))
    return logits.softmax(-1) if score == "softmax" else logits.sigmoid()


def score_distribution(scores: torch.Tensor, score: str) -> torch.Tensor:
    """The scores as a distribution over the experts: softmax's as they are, sigmoid's divided by their
    sum over the experts (``s_i / sum_j s_j``, as DeepSeek-V3's balance loss normalises them)."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def route(
    scores: torch.Tensor, k: int, normalize: bool, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-choice top-k: ``experts = topk(s + b, k)`` (``(T, k)``, best first), ``weights = s`` at
    those experts, divided by their sum when ``normalize``. The bias ``b`` changes the choice only."""
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    experts = choice.topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights


def expert_capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments one expert takes: ``floor(factor * tokens * k / experts)``; ``factor = 0``: ``tokens``
    (dropless: a token is never sent twice to one expert, so no expert gets more)."""
    if factor == 0:
        return tokens
    return math.floor(factor * tokens * k / experts + 1e-9)


def keep_mask(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments of ``experts`` (``(T, k)``) fit in the experts' ``capacity``: an expert takes
    them in priority order, all first choices (by token position) before all second choices, and so on."""
    t, k = experts.shape
    slot_major = experts.t().reshape(-1)
    onehot = F.one_hot(slot_major, n_experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in the expert's queue
    return (position < capacity).view(k, t).t()


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert (FP32, ``(E,)``) of ``experts`` (any shape of expert ids)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )


@dataclass
class Dispatch:
    """A micro-batch's assignments as the experts run them: ``token`` (the source row of each dispatched
    row, sorted by expert), ``weight`` (its gate, 0 for a padding row), ``counts`` (``E + 1`` entries: rows
    per expert, then the padding rows at the end, which the experts' kernels give to the last expert),
    ``dropped`` (assignments over capacity, a tensor)."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: torch.Tensor
    dropped: torch.Tensor


def dispatch(experts: torch.Tensor, weights: torch.Tensor, n_experts: int, capacity: int) -> Dispatch:
    """The rows the experts compute for assignments ``experts`` / ``weights`` (``(T, k)``) under
    ``capacity`` (:func:`expert_capacity`; ``>= T``: dropless, every assignment runs).

    With a capacity below ``T`` the kept assignments (:func:`keep_mask`) are sorted by expert and the
    dispatch holds exactly ``R = min(T k, E C)`` rows: the kept ones, then dropped ones as padding with
    weight 0 up to ``R``. ``R`` does not depend on the routing (a static shape, as for compile), and the
    experts never compute more than their capacity: a capacity factor ``f < 1`` computes ``f T k`` rows,
    not ``T k``."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    if capacity >= t:
        order = flat.argsort(stable=True)
        counts = torch.zeros(n_experts + 1, dtype=torch.long, device=flat.device).index_add_(
            0, flat, torch.ones_like(flat)
        )
        zero = torch.zeros((), device=flat.device)
        return Dispatch(order // k, weights.reshape(-1)[order], counts, zero)
    keep = keep_mask(experts, n_experts, capacity).reshape(-1)
    key = torch.where(keep, flat, n_experts)  # dropped: past the last expert, so sorted to the end
    rows = min(t * k, n_experts * capacity)
    order = key.argsort(stable=True)[:rows]
    per_expert = torch.zeros(n_experts + 1, dtype=torch.long, device=flat.device).index_add_(
        0, key, torch.ones_like(key)
    )[:n_experts]
    counts = torch.cat([per_expert, (rows - per_expert.sum()).reshape(1)])
    weight = torch.where(keep[order], weights.reshape(-1)[order], 0.0)
    dropped = (t * k - per_expert.sum()).float()
    return Dispatch(order // k, weight, counts, dropped)


def combine(outputs: torch.Tensor, d: Dispatch, tokens: int) -> torch.Tensor:
    """Each token's output ``sum_e g_e y_e``: the dispatched rows' ``outputs`` weighted by their gates and
    added into their source rows (``(tokens, width)``, in the outputs' dtype)."""
    out = torch.zeros(tokens, outputs.shape[-1], dtype=outputs.dtype, device=outputs.device)
    return out.index_add_(0, d.token, outputs * d.weight.to(outputs.dtype)[:, None])
