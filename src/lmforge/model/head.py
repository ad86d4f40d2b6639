"""The output head: an ``nn.Linear`` (no bias) whose call gives either the logits or, given targets, the
fused cross-entropy (``lmforge/model/fused_loss.py``).

The loss goes through the head's own call (``lm_head(hidden, targets, ...)``) rather than through a
function reading ``lm_head.weight``, so that whatever hooks the head module carries run for it: FSDP2's
pre-forward all-gather of an untied head (its own FSDP unit, ``parallel/data_parallel.py``) and its
pre-backward re-gather, in a pipeline's last stage too, where the loss runs outside the stage's forward.

Under tensor parallelism (``parallel/tensor.py``) the weight is a ``DTensor`` sharded by vocabulary rows
(``Shard(0)``; with tied embeddings the embedding's own parameter) and no hook rearranges the call: the
loss is computed vocabulary-parallel on this rank's rows (small all-reduces per chunk, no logits
gathered), and only a call for logits (sampling, evaluation, muP checks) all-gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lmforge.model.fused_loss import EAGER, Kernels, compiled_kernels, linear_cross_entropy


def compute_dtype(device: torch.device, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the head's matmuls: autocast's on ``device`` when it is on, else the weight's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


class OutputHead(nn.Linear):
    """``hidden (..., d) -> logits (..., V)``; with ``targets``, the cross-entropy of
    ``scale * logits`` summed (``reduction="sum"``: FP32 scalar) or per token (``"none"``: FP32,
    ``targets``' shape), ``chunk`` tokens at a time, -100 targets ignored.

    ``kernels``: the loss's element-wise kernels, eager until :meth:`compile_loss` (a plain attribute:
    parameter names and state dicts are those of ``nn.Linear``)."""

    kernels: Kernels = EAGER

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def compile_loss(self, **options) -> None:
        """Run the loss's element-wise kernels through ``torch.compile(**options)`` (the training
        objective's compilation cannot trace the fused loss: ``model/fused_loss.py`` says why)."""
        self.kernels = compiled_kernels(**options)

    def forward(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        scale: float = 1.0,
        chunk: int = 0,
        reduction: str = "sum",
    ) -> torch.Tensor:
        weight = self.weight
        if targets is None:
            if not isinstance(weight, DTensor):
                return F.linear(hidden, weight)
            # vocabulary-sharded: every rank's logits of its rows, gathered (not a training path)
            replicated = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
            return F.linear(replicated, weight).full_tensor()
        group, start = None, 0
        if isinstance(weight, DTensor):
            mesh = weight.device_mesh
            group, weight = mesh.get_group(), weight.to_local()
            start = mesh.get_local_rank() * weight.shape[0]  # Shard(0) of a vocabulary divisible by tp
        losses = linear_cross_entropy(
            hidden.flatten(0, -2),
            weight,
            targets.flatten(),
            scale=scale,
            chunk=chunk,
            reduction=reduction,
            dtype=compute_dtype(hidden.device, weight),
            group=group,
            vocab_start=start,
            kernels=self.kernels,
        )
        return losses if reduction == "sum" else losses.view(targets.shape)
