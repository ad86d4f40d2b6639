"""Autoregressive sampling with temperature, top-k and nucleus (top-p) filtering, with a key/value cache.

:func:`generate_batch` samples continuations of several prompts at once: the prompts, left-padded to the
longest, run through the model once (prefill), then one position per row and step against the cached
keys and values (``model/kv_cache.py``). Once the padded length reaches ``max_seq_len`` the cache is full,
and each later step recomputes every row's last ``max_seq_len`` tokens, as generation without a cache
does from the start (``use_cache=False``: the reference the cache is tested against).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from lmforge.model.kv_cache import KVCache, slot_mask, slot_positions
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


def pick(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> torch.Tensor:
    """The next token of each row (B,) from its logits (B, V): the argmax for ``temperature <= 0``, else a
    draw from ``softmax(filter(logits / temperature))``."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


class _Decoder:
    """The model's last-position logits for each row, step after step: through the key/value cache
    while it has room, else over each row's last ``max_seq_len`` tokens."""

    def __init__(self, model: Transformer, rows: list[list[int]], use_cache: bool):
        self.model, self.rows = model, rows
        device = next(model.parameters()).device
        longest = max(len(r) for r in rows)
        self.pad = torch.tensor([longest - len(r) for r in rows], device=device)
        self.cache = None
        if use_cache and longest <= model.max_seq_len:
            cfg, dtype = model.cfg, next(model.parameters()).dtype
            head_dim = cfg.d_model // cfg.n_heads
            n_kv = cfg.n_kv_heads or cfg.n_heads
            self.cache = KVCache(cfg.n_layers, len(rows), n_kv, head_dim, model.max_seq_len, dtype, device)
        self.device = device

    def prefill(self) -> torch.Tensor:
        if self.cache is None:
            return self._recompute()
        longest = max(len(r) for r in self.rows)
        ids = torch.tensor([[0] * (longest - len(r)) + r for r in self.rows], device=self.device)
        return self._cached(ids, 0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.length >= self.cache.capacity:
            return self._recompute()
        return self._cached(tokens[:, None], self.cache.length)

    def _cached(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        t = ids.shape[1]
        positions = slot_positions(self.pad, start, t)
        mask = slot_mask(self.pad, start, t)
        hidden = self.model.forward_cached(ids, positions, self.cache, mask)
        return self.model.logits(hidden[:, -1]).float()

    def _recompute(self) -> torch.Tensor:
        n = self.model.max_seq_len
        out = [self.model(torch.tensor([r[-n:]], device=self.device))[:, -1] for r in self.rows]
        return self.model.logits(torch.cat(out)).float()


@torch.no_grad()
def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    stop_tokens: Collection[int] = (),
    seed: int = 0,
    use_cache: bool = True,
) -> list[list[int]]:
    """Up to ``max_new_tokens`` tokens after each prompt (a row ends at its first token in
    ``stop_tokens``, which is not returned); ``temperature = 0`` is greedy. Row ``b``'s draws come from
    one generator seeded with ``seed``, so a one-row call draws as :func:`generate` does."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate_batch needs at least one prompt, each of at least one token")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    rows = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    decoder = _Decoder(model, rows, use_cache)
    logits = decoder.prefill()
    for i in range(max_new_tokens):
        nxt = pick(logits, temperature, top_k, top_p, gen)
        for b, token in enumerate(nxt.tolist()):
            if done[b]:
                continue
            if token in stop_tokens:
                done[b] = True
            else:
                out[b].append(token)
            rows[b].append(token)
        if all(done) or i == max_new_tokens - 1:
            break
        logits = decoder.step(nxt)
    model.train(was_training)
    return out


def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    stop_token: int | None = None,
    seed: int = 0,
    use_cache: bool = True,
) -> list[int]:
    """Sample up to ``max_new_tokens`` tokens after ``prompt``; ``temperature = 0`` is greedy
    (:func:`generate_batch` with one row)."""
    stops = () if stop_token is None else (stop_token,)
    return generate_batch(model, [prompt], max_new_tokens, temperature, top_k, top_p, stops, seed, use_cache)[
        0
    ]
