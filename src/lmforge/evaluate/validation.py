"""Validation loss, perplexity and the unigram baseline."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from lmforge.data.loader import Batch, TokenStream, eval_batches
from lmforge.precision import PrecisionPolicy


@torch.no_grad()
def evaluate(
    objective: nn.Module,
    stream: TokenStream,
    seq_len: int,
    batch_size: int,
    max_tokens: int,
    precision: PrecisionPolicy,
) -> float:
    """Mean next-token cross-entropy (nats) over the first ``max_tokens`` of ``stream``;
    ``objective(inputs, targets, doc_ids) -> (loss_sum, n_targets)`` (``model/loss.py``)."""
    total, count = loss_sum(objective, eval_batches(stream, seq_len, batch_size, max_tokens), precision)
    return total / max(count, 1)


@torch.no_grad()
def token_loss_sum(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], batches: Iterable[Batch], precision: PrecisionPolicy
) -> tuple[float, int]:
    """``(sum of next-token cross-entropies in nats, number of targets)`` of ``fn(inputs, targets,
    doc_ids) -> (loss_sum, n_targets)`` over ``batches`` in the precision's autocast (the caller sets
    eval mode)."""
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(precision.device)
        with precision.autocast():
            part, n = fn(batch.inputs, batch.targets, batch.doc_ids)
        total += float(part)
        count += int(n)
    return total, count


def loss_sum(objective: nn.Module, batches: Iterable[Batch], precision: PrecisionPolicy) -> tuple[float, int]:
    """:func:`token_loss_sum` of ``objective`` in eval mode (its mode given back afterwards)."""
    was_training = objective.training
    objective.eval()
    try:
        return token_loss_sum(objective, batches, precision)
    finally:
        objective.train(was_training)


def eval_targets(stream: TokenStream, seq_len: int, max_tokens: int) -> np.ndarray:
    """The target tokens that :func:`evaluate` scores, flattened."""
    return np.concatenate([b.targets.numpy().ravel() for b in eval_batches(stream, seq_len, 256, max_tokens)])


def unigram_loss(train_counts: np.ndarray, targets: np.ndarray) -> float:
    """Cross-entropy (nats) of ``targets`` under the add-one-smoothed unigram distribution of training tokens.

    ``p(v) = (c_v + 1) / (C + V)`` with ``c_v`` the training count of token ``v``, ``C`` the total count
    and ``V`` the vocabulary size; the loss is ``-mean_t log p(y_t)``.
    """
    counts = train_counts.astype(np.float64)
    logp = np.log(counts + 1.0) - math.log(counts.sum() + len(counts))
    return float(-logp[targets].mean())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
