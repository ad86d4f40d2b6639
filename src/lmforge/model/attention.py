"""Causal self-attention kernels and rotary position embeddings.

Three paths, all computing ``softmax(s q k^T + M) v`` (``s = 1 / sqrt(d)`` unless given; muP passes
its ``1 / d`` form) with ``M`` the causal mask, optionally
intersected with the document mask (token ``i`` sees token ``j`` only if ``j <= i`` and both lie in the
same document of the packed sequence):

* plain causal: ``F.scaled_dot_product_attention(is_causal=True)``;
* document-masked SDPA: an explicit boolean mask, works in training on every device;
* document-masked FlexAttention: a block-sparse mask, CUDA only (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def rope_cache(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables of shape (max_len, head_dim) for RoPE.

    Frequencies ``f_i = theta^(-2i / d)`` for ``i < d/2``; angle of position ``p`` is ``p * f_i``; each
    table repeats the half-width block twice (the "rotate half" layout used by Llama and HF).
    """
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D): ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``."""
    a, b = x.chunk(2, dim=-1)
    rotated = torch.cat([-b, a], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask: ``mask[b, 0, i, j] = j <= i and doc[b, i] == doc[b, j]``."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


@functools.cache
def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), create_block_mask


def flex_block_mask(doc_ids: torch.Tensor):
    """FlexAttention BlockMask for causal attention within documents (built once per batch)."""
    _, create_block_mask = _flex()

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (doc_ids[b, q] == doc_ids[b, kv])

    b, t = doc_ids.shape
    return create_block_mask(mask_mod, b, None, t, t, device=doc_ids.device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    block_mask=None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over (B, H, T, D) tensors; ``k`` and ``v`` may have fewer heads (GQA); ``scale`` of the
    logits (None: ``1 / sqrt(D)``)."""
    gqa = k.shape[1] != q.shape[1]
    if block_mask is not None:
        flex, _ = _flex()
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    if gqa:  # repeat kv heads: SDPA's enable_gqa falls back to slow paths on some backends
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
