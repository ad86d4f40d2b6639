"""Whole-tensor steps for sharded parameters (DTensor: FSDP2 and tensor-parallel shards).

Under FSDP2 (and tensor parallelism) a parameter and its gradient are ``DTensor`` s: each rank holds a
shard, in any placement (``Shard(0)`` for FSDP2 on one mesh dimension, ``(_StridedShard(0), Shard(0))``
or ``(Shard(0), Shard(1))`` with TP underneath). Element-wise optimizers (AdamW, SGD, Lion) work on
the shards as they are. Optimizers whose update of one value depends on the whole matrix (Muon's
Newton-Schulz, Adafactor's row and column statistics and update norm) gather the matrix with
:func:`full`, compute the update exactly as a single process would, and keep this rank's part with
:func:`shard_like`, which slices locally (no communication). Every rank computes the whole update:
one all-gather of the tensor per step and the update's arithmetic repeated on each rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (of any placements)."""
    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a ``DTensor``; ``t`` itself otherwise)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``whole`` (the same on every rank) cut the way ``like`` is: this rank's part as a ``DTensor`` with
    ``like``'s mesh and placements, taken locally without communication; ``whole`` if ``like`` is plain."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)
