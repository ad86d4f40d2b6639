"""The formulas of the detail records (``train/callbacks/detail.py``): which part of the model a parameter
belongs to, norms per part, the update ratio, the RMS of an activation and the entropy of attention rows.

Parts: each parameter belongs to its block ``block.<i>`` (``blocks.<i>.``...; none outside the blocks)
and to one kind: ``embedding`` (token and, for GPT-2, position embeddings), ``attention`` (q, k, v, o
projections), ``mlp``, ``norm`` (the blocks' norms and the final norm) and ``head`` (an untied output
head; a tied one is the embedding's tensor and counted there once). The kinds partition the parameters,
so ``sum_kind n_kind^2 = n^2`` for any of the norms below.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lmforge.optim.clip import total_norm

KINDS = ("embedding", "attention", "mlp", "norm", "head")


def param_kind(name: str) -> str:
    """The kind of the parameter called ``name`` in the plain model (``model/transformer.py``)."""
    first, _, rest = name.partition(".")
    if first in ("embed", "pos_embed"):
        return "embedding"
    if first == "lm_head":
        return "head"
    if first == "norm":
        return "norm"
    if first == "blocks":
        part = rest.split(".")[1]
        if part == "attn":
            return "attention"
        if part == "mlp":
            return "mlp"
        if part in ("attn_norm", "mlp_norm"):
            return "norm"
    raise ValueError(f"parameter {name!r} belongs to no known part of the model")


def param_block(name: str) -> int | None:
    """The block index of parameter ``name`` (``blocks.<i>.``...), None outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def part_keys(n_layers: int, tied: bool) -> list[str]:
    """Every part of the whole model, in a fixed order: ``block.0`` .. ``block.<L-1>``, then the kinds (the
    head only when untied). Every process lists the same keys, whichever parameters it holds."""
    return [f"block.{i}" for i in range(n_layers)] + [k for k in KINDS if k != "head" or not tied]


def parts_of(name: str) -> list[str]:
    """The part keys parameter ``name`` counts in: its block (if any) and its kind."""
    block = param_block(name)
    return ([f"block.{block}"] if block is not None else []) + [param_kind(name)]


def group_by_part(named: dict[str, torch.Tensor], keys: list[str]) -> dict[str, list[torch.Tensor]]:
    """``{part: [tensors]}`` for every key in ``keys`` (empty lists for parts this process lacks)."""
    groups: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for name, t in named.items():
        for key in parts_of(name):
            groups[key].append(t)
    return groups


def part_norms(
    groups: dict[str, list[torch.Tensor]],
    device: torch.device,
    across: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm ``sqrt(sum_i t_i^2)`` of each group's tensors, stacked in the groups' order (FP32, on
    ``device``). Sharded tensors (DTensors) count their whole tensor (``optim/clip.py::total_norm``);
    ``across`` (the pipeline group) adds the squares of processes holding other parts: one all-reduce."""
    norms = torch.stack([total_norm(ts).to(device=device, dtype=torch.float32) for ts in groups.values()])
    if across is not None:
        squared = norms**2
        dist.all_reduce(squared, group=across)
        norms = squared.sqrt()
    return norms


def update_ratio(delta_norm: float, before_norm: float) -> float:
    """``||theta_after - theta_before|| / ||theta_before||`` from the two norms (0 for a zero ``theta``)."""
    return delta_norm / before_norm if before_norm > 0 else 0.0


def rms(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean(x^2))`` over every element, in FP32."""
    return x.float().pow(2).mean().sqrt()


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None = None,
    max_elements: int = 1 << 22,
) -> torch.Tensor:
    """Entropy (nats) of every attention row of one sequence: ``(H, T)``.

    ``q`` (H, T, D) and ``k`` (H_kv, T, D) after RoPE (with fewer kv heads each is repeated, as
    ``model/attention.py::attend`` does); ``allowed`` (T, T) bool: query ``i`` may see key ``j`` (the causal
    mask, intersected with the document mask). Row ``i`` of head ``h``: ``s_j = scale * q_i . k_j`` for
    allowed ``j`` (``scale`` None: ``1 / sqrt(D)``), ``p = softmax(s)``, ``H_i = -sum_j p_j log p_j``; a row
    that may see ``n`` keys scores between 0 and ``log n``. Computed in FP32 over chunks of at most
    ``max_elements`` scores, so memory stays bounded for long sequences.
    """
    h, t, d = q.shape
    if k.shape[0] != h:
        k = k.repeat_interleave(h // k.shape[0], dim=0)
    s = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(h, t, dtype=torch.float32, device=q.device)
    rows = max(1, max_elements // t)  # query rows per chunk
    for head in range(h):
        kh = k[head].float().T
        for start in range(0, t, rows):
            scores = (q[head, start : start + rows].float() @ kh) * s
            mask = allowed[start : start + rows]
            logp = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[head, start : start + rows] = -(logp.exp() * logp).masked_fill(~mask, 0.0).sum(-1)
    return out
