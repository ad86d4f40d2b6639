"""The training objective: next-token cross-entropy through a chunked output head.

:class:`ChunkedCrossEntropy` returns the *sum* of token cross-entropies (in FP32) and the number of
target tokens (``targets != -100``); the trainer divides by the number of target tokens of the whole
optimizer step (all micro-batches, all ranks), so accumulation and data parallelism give the same
gradient as one large batch.

The output head and softmax run over chunks of ``chunk`` tokens, so the full (tokens x vocab) logits
never exist in FP32 at once: peak memory of the head is ``chunk * vocab`` values instead of
``B * T * vocab``.

:class:`NextTokenLoss` is the model and this loss as one module: ``(inputs, targets, doc_ids) ->
(loss_sum, n_targets)``. It is what a training step calls and what ``torch.compile`` wraps (the blocks,
the head and the loss in one graph), so nothing on the model instance is ever replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.transformer import Transformer


class ChunkedCrossEntropy(nn.Module):
    """``sum_t CE(head(h_t), y_t)`` over targets ``!= -100``, computed ``chunk`` tokens at a time
    (``chunk = 0``: all at once)."""

    def __init__(self, chunk: int = 1024):
        super().__init__()
        self.chunk = chunk

    def forward(
        self, hidden: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden.flatten(0, -2)
        targets = targets.flatten()
        chunk = self.chunk or hidden.shape[0]
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.split(chunk), targets.split(chunk), strict=True):
            logits = head(h).float()
            total = total + F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
        return total, (targets != -100).sum()


class NextTokenLoss(nn.Module):
    """``model`` followed by :class:`ChunkedCrossEntropy` on its output head."""

    def __init__(self, model: Transformer, chunk: int = 1024):
        super().__init__()
        self.model = model
        self.loss = ChunkedCrossEntropy(chunk)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loss(self.model(inputs, doc_ids), targets, self.model.logits)
