from __future__ import annotations

import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.attention import document_causal_mask
from lmforge.model.sampling import filter_logits, generate
from lmforge.model.transformer import Transformer, ff_width
from tests.conftest import loss_of, model_of

V, T = 97, 24


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return model_of(ModelConfig(n_layers=2, d_model=32, n_heads=4, **kw), V, T)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("tie", [True, False])
def test_forward_shapes_and_loss(arch, tie):
    m = _model(arch=arch, tie_embeddings=tie)
    x = torch.randint(0, V, (3, T))
    assert m.logits(m(x)).shape == (3, T, V)
    # at init: close to uniform, log(V): logits of std ~0.02 * sqrt(d) lift the loss by about half their
    # variance; measured within 0.34% of log(V) in all four cases, so 5% is not rounding but the model
    loss_sum, n = loss_of(m, x, torch.randint(0, V, (3, T)))
    assert int(n) == 3 * T and math.isclose(loss_sum.item() / int(n), math.log(V), rel_tol=0.05)
    assert (m.lm_head.weight is m.embed.weight) == tie


def test_llama_and_gpt2_layout():
    llama, gpt2 = _model(arch="llama"), _model(arch="gpt2")
    names = {n for n, _ in llama.named_parameters()}
    assert "blocks.0.mlp.gate_proj.weight" in names and "blocks.0.attn.q_proj.bias" not in names
    assert isinstance(llama.blocks[0].attn_norm, torch.nn.RMSNorm) and llama.pos_embed is None
    assert isinstance(gpt2.blocks[0].attn_norm, torch.nn.LayerNorm) and gpt2.pos_embed is not None
    assert gpt2.blocks[0].attn.q_proj.bias is not None and ff_width(gpt2.cfg) == 128
    assert ff_width(llama.cfg) == 128  # 8/3 * 32 rounded up to 64


def test_grouped_query_attention():
    m = _model(n_kv_heads=2)
    assert m.blocks[0].attn.k_proj.weight.shape == (16, 32)
    assert m.logits(m(torch.randint(0, V, (2, T)))).shape == (2, T, V)


def test_initialisation():
    torch.manual_seed(0)
    m = model_of(ModelConfig(arch="gpt2", n_layers=8, d_model=256, n_heads=4), 1000, 16)
    # Sample standard deviations of N seeded normal draws: standard error std / sqrt(2N), 5.5e-5 (q_proj),
    # 1.4e-5 (o_proj), 6.9e-6 (fc_out). Measured (seed 0): +2.1e-5, +2.1e-5, +8e-7. The bounds are 18, 14
    # and 29 standard errors; a missing 1/sqrt(2L) would be off by 0.015
    assert abs(m.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 1e-3
    # the bounds of the next two: 14 and 29 standard errors, see above
    assert abs(m.blocks[0].attn.o_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 2e-4
    assert abs(m.blocks[3].mlp.fc_out.weight.std().item() - 0.02 / math.sqrt(16)) < 2e-4
    assert (m.blocks[0].attn.q_proj.bias == 0).all() and (m.blocks[0].attn_norm.weight == 1).all()


def test_document_mask():
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    mask = document_causal_mask(doc)[0, 0]
    assert mask.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_changing_one_document_leaves_the_others_unchanged(arch):
    m = _model(arch=arch)
    x = torch.randint(0, V, (1, T))
    doc = torch.tensor([[0] * 8 + [1] * 10 + [2] * 6])
    y = x.clone()
    y[0, 8:18] = torch.randint(0, V, (10,))  # replace the middle document
    a, b = m.logits(m(x, doc)), m.logits(m(y, doc))
    keep = doc[0] != 1
    # masked keys weigh exactly 0 and both calls have the same shapes: measured bitwise equal (2-core AMD
    # EPYC with AVX-512-BF16); 1e-6 is ~8 FP32 ulps of these logits (< 1), room for a kernel that blocks
    # the keys by content. A leak across documents moves them by 0.03 to 0.8 (the asserts below)
    torch.testing.assert_close(a[0, keep], b[0, keep], rtol=0, atol=1e-6)
    # allclose's defaults (rtol 1e-5, atol 1e-8): the changed document's logits move by 0.03 to 0.8 (above)
    assert not torch.allclose(a[0, ~keep], b[0, ~keep])
    # and without the mask, later documents do see the change
    c, d = m.logits(m(x)), m.logits(m(y))
    # the same defaults, far below the 0.03 to 0.8 the change moves logits that see it (see above)
    assert not torch.allclose(c[0, 18:], d[0, 18:])


def test_doc_mask_matches_plain_causal_for_one_document():
    m = _model()
    x = torch.randint(0, V, (2, T))
    # an all-true document mask or the causal flag: softmaxes of <= 24 keys in FP32 (24 u = 1.4e-6 worst
    # case, u = 2^-24); measured bitwise equal
    torch.testing.assert_close(m(x, torch.zeros(2, T, dtype=torch.long)), m(x), rtol=1e-5, atol=1e-5)


def test_chunked_loss_equals_full_loss():
    m = _model()
    x, y = torch.randint(0, V, (2, T)), torch.randint(0, V, (2, T))
    y[0, :3] = -100
    s, n = loss_of(m, x, y, chunk=7)
    ref = torch.nn.functional.cross_entropy(m.logits(m(x)).flatten(0, 1), y.flatten(), reduction="sum")
    # FP32 sums of 45 token losses in chunks of 7 or at once (45 u = 2.7e-6 relative worst case); measured
    # bitwise equal
    torch.testing.assert_close(s, ref, rtol=1e-5, atol=1e-4)
    assert int(n) == 2 * T - 3


def test_sampling_filters_and_is_seeded():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    # probs ~ [0.64, 0.24, 0.09, 0.03]: top_p=0.8 keeps the first two
    assert torch.isinf(filter_logits(logits, top_p=0.8)).tolist() == [[False, False, True, True]]
    m = _model()
    a = generate(m, [1, 2, 3], 10, seed=3)
    assert a == generate(m, [1, 2, 3], 10, seed=3) and len(a) == 10
    greedy = generate(m, [1, 2, 3], 5, temperature=0)
    assert greedy == generate(m, [1, 2, 3], 5, temperature=0, seed=9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention training needs CUDA")
def test_flex_attention_matches_sdpa_mask_on_cuda():
    torch.manual_seed(0)
    cfg = dict(n_layers=2, d_model=64, n_heads=4)
    flex = model_of(ModelConfig(**cfg), V, 128, attention="flex").cuda()
    sdpa = model_of(ModelConfig(**cfg), V, 128, attention="sdpa").cuda()
    sdpa.load_state_dict(flex.state_dict())
    x = torch.randint(0, V, (2, 128), device="cuda")
    doc = torch.cumsum(torch.rand(2, 128, device="cuda") < 0.05, dim=1)
    a, b = loss_of(flex, x, x, doc)[0], loss_of(sdpa, x, x, doc)[0]
    # two CUDA attention kernels (FlexAttention's and SDPA's, TF32 not enabled): sums of 256 tokens' losses
    # and 128-key softmaxes in other orders; not measured here (no GPU): 1e-4 is ~2 n u for n = 128 + 256
    # with u = 6e-8 at worst, and a wrong mask moves the loss by far more
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    a.backward()
    b.backward()
    # gradients through both backward kernels: the loss's bound, 10x for the second pass (not measured)
    torch.testing.assert_close(flex.embed.weight.grad, sdpa.embed.weight.grad, rtol=1e-3, atol=1e-4)
