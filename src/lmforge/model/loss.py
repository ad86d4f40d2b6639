"""The training objective: next-token cross-entropy through the fused output head.

:func:`head_loss` computes the cross-entropy of the model's output head against the targets through the
head's own call (``model/head.py::OutputHead``), with the head and the softmax fused chunk by chunk in
forward and backward (``model/fused_loss.py``): the (tokens x vocab) logits and their gradient never
exist, and what is kept for backward is the hidden states and one log-sum-exp per token (backward
recomputes each chunk's logits). Logits are computed in the compute
dtype (BF16 under autocast) and the softmax and loss in FP32; muP's output multiplier
(``Transformer.logit_scale``) is applied; targets ``-100`` are ignored. Under tensor parallelism the
head is vocabulary-sharded and the loss vocabulary-parallel (``parallel/tensor.py``).

:class:`NextTokenLoss` is the model and this loss as one module: ``(inputs, targets, doc_ids) ->
(loss_sum, n_targets)``, the *sum* of token cross-entropies (FP32) and the number of target tokens
(``targets != -100``); the trainer divides by the number of target tokens of the whole optimizer step
(all micro-batches, all ranks), so accumulation and data parallelism give the same gradient as one
large batch. It is what a training step calls and what ``torch.compile`` wraps (the blocks, the head and
the loss in one graph), so nothing on the model instance is ever replaced.

``chunk`` (``train.loss_chunk``) is how many tokens one step of the fused loop takes (0: all at once):
it bounds the temporaries, one chunk's FP32 logits and their compute-dtype copy.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.transformer import Transformer


def head_loss(
    model: Transformer, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, reduction: str = "sum"
) -> torch.Tensor:
    """Cross-entropy of ``model``'s output head on ``hidden`` (``(..., d)``) against ``targets``
    (``hidden``'s leading shape): the FP32 sum (``reduction="sum"``) or per-token values (``"none"``,
    ``targets``' shape, 0 where ignored), ``chunk`` tokens at a time."""
    if model.lm_head is None:
        raise RuntimeError("this pipeline stage has no output head")
    return model.lm_head(hidden, targets, scale=model.logit_scale, chunk=chunk, reduction=reduction)


class NextTokenLoss(nn.Module):
    """``model`` followed by :func:`head_loss` (the sum) on its output head."""

    def __init__(self, model: Transformer, chunk: int = 1024):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(inputs, doc_ids)
        return head_loss(self.model, hidden, targets, self.chunk), (targets != -100).sum()
