"""The key/value cache of autoregressive generation, and the masks and positions of left-padded batches.

Generation without a cache runs the whole sequence through the model for every new token: ``O(n^2)``
token computations for ``n`` tokens. With the cache, the prompt runs once (prefill) and each block keeps
its keys and values; every later step computes one position per row and attends to the cached ones.

A batch of prompts of different lengths is left-padded to the longest: row ``b`` has ``pad[b]`` padding
slots before its first token, so every row's next token lands in the same slot. Slot ``i`` of row ``b``
holds position ``p = i - pad[b]`` (RoPE angle or learned position ``p``, as in a one-row run), and a query
in slot ``i`` sees slot ``j`` when ``pad[b] <= j <= i``: exactly what the row sees alone. A padding slot's
query sees itself only, so its softmax is defined; nothing reads its output.

Keys and values are stored after RoPE, per KV head (GQA caches ``n_kv_heads``, not ``n_heads``), in the
model's dtype, in tensors of ``capacity`` slots allocated once: ``2 x layers x B x n_kv x capacity x
head_dim`` values.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One block's keys and values: ``(B, n_kv, capacity, head_dim)`` each, the first :attr:`length` slots
    filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values, self.length = keys, values, 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` (B, n_kv, T, head_dim) after the filled slots; return every filled slot's."""
        end = self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"the key/value cache holds {self.keys.shape[2]} positions; {end} asked")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every block's :class:`LayerCache` for a batch of ``batch`` rows and ``capacity`` slots."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.layers = [
            LayerCache(
                torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
            )
            for _ in range(n_layers)
        ]
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Slots filled (the same in every layer)."""
        return self.layers[0].length if self.layers else 0


def slot_positions(pad: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Positions (B, count) of slots ``start .. start + count - 1``: ``max(i - pad[b], 0)`` (padding
    slots get position 0; their outputs are never read)."""
    slots = torch.arange(start, start + count, device=pad.device)
    return (slots[None, :] - pad[:, None]).clamp(min=0)


def slot_mask(pad: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Boolean (B, 1, count, start + count): query slot ``i`` (from ``start``) of row ``b`` sees key slot
    ``j`` when ``pad[b] <= j <= i``, or ``j == i`` (a padding slot sees itself)."""
    q = torch.arange(start, start + count, device=pad.device)[:, None]
    k = torch.arange(start + count, device=pad.device)[None, :]
    seen = (k <= q)[None] & (k[None] >= pad[:, None, None])
    return (seen | (k == q)[None])[:, None]
