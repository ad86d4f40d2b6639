"""Bytes of optimizer state: what an optimizer keeps in memory besides the parameters themselves."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of ``t``: a DTensor's local shard (FSDP2 and tensor-parallel states); a
    tensor subclass (e.g. torchao's 8-bit state) counts its inner tensors."""
    if isinstance(t, DTensor):
        return tensor_bytes(t.to_local())
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return sum(tensor_bytes(x) for x in inner if isinstance(x, torch.Tensor))
    return t.numel() * t.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Sum of the bytes of every tensor in ``optimizer.state`` (moments, step counters, code books)."""
    return sum(
        tensor_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def state_bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """``state_bytes / number of parameters`` over all groups (8 for AdamW's two FP32 moments, plus steps)."""
    n = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    return state_bytes(optimizer) / n
