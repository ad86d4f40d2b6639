"""Log-likelihood of continuations given contexts: what multiple-choice tasks are scored by.

A (context, continuation) pair of texts becomes two token lists as lm-evaluation-harness makes them
(:func:`split_pair`): the context's trailing whitespace moves to the continuation, ``context`` and
``context + continuation`` are encoded, and the continuation's tokens are the whole's after the
context's (the split falls on a token boundary even where the tokenizer would merge across it). The
context is led by ``<|endoftext|>``, as every document is in training (``data/prepare.py``).

:func:`continuation_logprobs` scores the pairs in batches: each row is ``context + continuation``, cut
from the left to its last ``max_seq_len + 1`` tokens, right-padded (the model is causal, so padding
after a row changes none of its positions). The score of a pair is

    log p(continuation | context) = sum_{i=1..m} log softmax(logits_{c+i-1})[y_{c+i}]

over the continuation's ``m`` tokens ``y_{c+1..c+m}``, in nats, with ``is_greedy`` True when each of them
is the argmax of its position's logits. A continuation longer than the model's positions is scored in
several windows (:func:`windows`), where lm-evaluation-harness would fail.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer


def split_pair(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens led by ``<|endoftext|>``, continuation tokens) of a pair of texts."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation)
    head = tok.encode(context) if context else []
    return [tok.eot_id, *head], whole[len(head) :]


def windows(ids: list[int], m: int, length: int) -> list[tuple[list[int], list[int]]]:
    """The forward passes that score the last ``m`` tokens of ``ids`` with a model of ``length`` positions:
    ``(inputs, targets)`` each, ``targets`` the next tokens of ``inputs``' last ``len(targets)`` positions.
    One window of the last ``length + 1`` tokens when the continuation fits in it; else, backwards,
    windows of up to ``length`` inputs, each ending where the next one begins scoring, so every
    continuation token is scored once, seeing the tokens before it in its window."""
    out, end = [], len(ids)
    while m > 0:
        begin = max(0, end - 1 - length)
        k = min(m, end - 1 - begin)
        out.append((ids[begin : end - 1], ids[end - k : end]))
        end, m = end - k, m - k
    return out


@torch.no_grad()
def continuation_logprobs(
    model: Transformer,
    pairs: list[tuple[list[int], list[int]]],
    batch_size: int = 16,
    autocast=None,
) -> list[tuple[float, bool]]:
    """``(log p(continuation | context) in nats, is_greedy)`` of each ``(context ids, continuation ids)``
    pair (both non-empty), in the order given; ``autocast``: a context manager to run the forward passes
    in (None: the model's dtype). A pair longer than the model's ``max_seq_len + 1`` positions is cut from
    the left; a continuation longer than that is scored in several windows (:func:`windows`)."""
    if any(not cont for _, cont in pairs) or any(not ctx for ctx, _ in pairs):
        raise ValueError("continuation_logprobs needs a non-empty context and continuation in every pair")
    device = next(model.parameters()).device
    pieces = [
        (i, *w)
        for i, (ctx, cont) in enumerate(pairs)
        for w in windows(ctx + cont, len(cont), model.max_seq_len)
    ]
    pieces.sort(key=lambda p: -len(p[1]))  # similar lengths share a batch
    sums, greedy = [0.0] * len(pairs), [True] * len(pairs)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(pieces), batch_size):
            chunk = pieces[start : start + batch_size]
            ids = torch.zeros(len(chunk), max(len(p[1]) for p in chunk), dtype=torch.long)
            for r, (_, inputs, _) in enumerate(chunk):
                ids[r, : len(inputs)] = torch.tensor(inputs)
            with autocast if autocast is not None else nullcontext():
                logits = model.logits(model(ids.to(device)))
            logp = torch.log_softmax(logits.float(), dim=-1)
            for r, (i, inputs, targets) in enumerate(chunk):
                n, k = len(inputs), len(targets)
                part = logp[r, n - k : n]
                target = torch.tensor(targets, device=device)
                sums[i] += float(part.gather(-1, target[:, None]).sum())
                greedy[i] = greedy[i] and bool((part.argmax(-1) == target).all())
    finally:
        model.train(was_training)
    return list(zip(sums, greedy, strict=True))
