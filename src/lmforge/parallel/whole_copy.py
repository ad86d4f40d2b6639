"""A whole, plain copy of a sharded model in each process, refreshed from the shards on demand.

Under FSDP2 (``parallel.dp_shard > 1``, ZeRO-2/3, hybrid sharding) a process holds a shard of every
parameter, and a forward gathers each block's parameters through FSDP2's hooks: a collective that every
rank of the mesh must enter the same number of times. Autoregressive sampling does not fit that: each
rank draws other completions, which stop after other numbers of tokens, so the ranks' forwards would not
pair up (and the root's embedding and head are gathered only around the root's own forward). RL
(``posttrain/rl.py``) therefore samples from a :class:`WholeCopy`: before each rollout every rank gathers
the current weights into a plain model of its own (:meth:`WholeCopy.refresh`: one all-gather per sharded
tensor, ``DTensor.full_tensor``, in the same order on every rank, the only collective), then samples
from it with no collective at all, as one process would.

Tensor parallelism (``parallel.tp > 1``) is the same case: a process holds ``1 / tp`` of each projection,
of the heads and of the vocabulary, and a forward through the plan needs every rank of the group in step
at every token, on sequences a multiple of ``tp`` long, which a token-by-token decode with a key/value
cache is not. The copy is gathered from the tensor-parallel DTensors (``Shard`` or ``Replicate``; a 2-D
mesh with FSDP2 alike) by the same ``full_tensor``; RL then samples on the group's first rank only and
hands the completions to the others, whose training forward must see the same rows (``posttrain/rl.py``).

Expert parallelism (``parallel.ep > 1``) is the same case again: a rank holds ``experts / ep`` of each MoE
layer's experts, and a forward exchanges rows with the other ranks of its expert group by all-to-all at
every MoE layer, which ranks decoding other numbers of tokens cannot keep in step. The experts are
DTensors sharded on dim 0 over the group, gathered by the same ``full_tensor``; the copy is a plain model
with no exchange, and each rank samples its own prompts from it.

Cost: the memory of one more whole model per process (as RL's frozen reference, also whole), and one
all-gather of the weights per rollout, the bytes of one ZeRO-3 forward's gathers. A tensor that is not
sharded (DDP, ZeRO-1, a buffer, a parameter FSDP2 holds gathered between micro-batches of a ZeRO-2 step)
is copied as it is.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(itertools.chain(module.named_parameters(), module.named_buffers()))


class WholeCopy:
    """``copy`` (a plain model of ``source``'s class and names, on this process's device) kept equal to
    ``source`` (sharded or not) by :meth:`refresh`."""

    def __init__(self, source: nn.Module, copy: nn.Module):
        ours, theirs = _tensors(source), _tensors(copy)
        if ours.keys() != theirs.keys():
            missing = sorted(ours.keys() ^ theirs.keys())[:3]
            raise ValueError(f"WholeCopy: the copy's tensors are not the source's ({missing} ...)")
        self.source, self.copy = source, copy.requires_grad_(False)

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """Gather ``source``'s current values into ``copy`` and return it; every rank must call it, in
        step (the gathers are collectives)."""
        mine = _tensors(self.copy)
        for name, value in _tensors(self.source).items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            mine[name].copy_(whole)
        return self.copy
