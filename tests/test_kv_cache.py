"""Generation with a key/value cache (``model/kv_cache.py``, ``model/sampling.py``) against the model's own
full forward over each row alone: the logits of every step, greedy tokens, sampling, stop tokens, and the
positions computed."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.sampling import generate_batch
from lmforge.model.transformer import Transformer

V, MAX_LEN = 97, 40
ARCHS = {
    "llama-gqa-tied": ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2),
    "llama-untied": ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, tie_embeddings=False),
    "gpt2": ModelConfig(arch="gpt2", n_layers=2, d_model=64, n_heads=4),
    "llama-moe": ModelConfig(
        arch="llama", n_layers=2, d_model=64, n_heads=4, moe={"experts": 4, "top_k": 2, "d_expert": 32}
    ),
}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
# FP32: the cached step attends with an explicit mask over the cached keys, the full forward with
# SDPA's causal kernel over the whole row; the two sum the same products in another order, a few ulps
# of logits of size ~1 (measured at most 3.6e-7 on a 2-core Intel Xeon with AVX-512-BF16 and AMX)
LOGIT_ATOL = 1e-5


def _model(name: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARCHS[name], V, MAX_LEN)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("name", list(ARCHS))
def test_every_steps_logits_equal_the_full_forward_of_each_row(name):
    """Left-padded batch: prefill, then 12 cached steps; at each, every row's last logits equal the
    model's plain forward over that row alone (no padding, no cache)."""
    from lmforge.model.kv_cache import KVCache, slot_mask, slot_positions

    model, cfg = _model(name), ARCHS[name]
    rows = [list(p) for p in PROMPTS]
    longest = max(map(len, rows))
    pad = torch.tensor([longest - len(r) for r in rows])
    cache = KVCache(cfg.n_layers, len(rows), cfg.n_kv_heads or cfg.n_heads, 16, MAX_LEN, torch.float32, "cpu")
    ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows])
    worst = 0.0
    with torch.no_grad():
        for _ in range(13):
            start = cache.length
            hidden = model.forward_cached(
                ids, slot_positions(pad, start, ids.shape[1]), cache, slot_mask(pad, start, ids.shape[1])
            )
            got = model.logits(hidden[:, -1])
            for b, row in enumerate(rows):
                want = model.logits(model(torch.tensor([row]))[:, -1])[0]
                worst = max(worst, (got[b] - want).abs().max().item())
            nxt = got.argmax(-1)
            for b in range(len(rows)):
                rows[b].append(int(nxt[b]))
            ids = nxt[:, None]
    print(f"{name}: largest |cached - full| logit {worst:.2g}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_generation_is_the_cache_free_generation_token_for_token(name):
    """Batched and one row at a time, past ``max_seq_len`` (9 + 45 > 40: the window then slides)."""
    model = _model(name)
    batched = generate_batch(model, PROMPTS, 45, temperature=0)
    alone = [generate_batch(model, [p], 45, temperature=0)[0] for p in PROMPTS]
    reference = [generate_batch(model, [p], 45, temperature=0, use_cache=False)[0] for p in PROMPTS]
    assert batched == alone == reference
    assert all(len(out) == 45 for out in batched)


def test_sampling_draws_the_same_tokens_with_and_without_the_cache():
    model = _model("llama-gqa-tied")
    for seed in range(3):
        kw = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": seed}
        assert generate_batch(model, PROMPTS[:1], 30, **kw) == generate_batch(
            model, PROMPTS[:1], 30, use_cache=False, **kw
        )


def test_each_row_stops_at_its_own_stop_token():
    model = _model("gpt2")
    free = generate_batch(model, PROMPTS, 20, temperature=0)
    stop = free[1][3]  # a token of row 1's greedy continuation
    out = generate_batch(model, PROMPTS, 20, temperature=0, stop_tokens={stop})
    for row, full in zip(out, free, strict=True):
        cut = full.index(stop) if stop in full else len(full)
        assert row == full[:cut]
    assert len(out[1]) == free[1].index(stop) <= 3  # row 1 did stop, the others went on or stopped too


def test_the_cache_computes_each_position_once():
    """Positions run through the embedding: the prompt once (padded) and one per new token with the cache;
    the whole row again for every token without it."""
    model = _model("llama-gqa-tied")
    seen: list[int] = []
    model.embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].numel()))
    generate_batch(model, [PROMPTS[0]], 10, temperature=0)
    assert sum(seen) == len(PROMPTS[0]) + 9  # the last token is never fed back
    seen.clear()
    generate_batch(model, [PROMPTS[0]], 10, temperature=0, use_cache=False)
    assert sum(seen) == sum(len(PROMPTS[0]) + i for i in range(10))
