"""Autoregressive sampling with temperature, top-k and nucleus (top-p) filtering."""

from __future__ import annotations

import torch

from lmforge.model.transformer import Transformer


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the ``top_k`` largest and outside the smallest set whose
    probability mass reaches ``top_p`` (the most likely token is always kept)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    stop_token: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt``; ``temperature = 0`` is greedy."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = ids[:, -model.max_seq_len :]
        logits = model.logits(model(context)[:, -1]).float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        token = int(nxt)
        if stop_token is not None and token == stop_token:
            break
        out.append(token)
        ids = torch.cat([ids, nxt], dim=1)
    model.train(was_training)
    return out
