"""The activation formula (lmforge/plan/activations.py) under FSDP2's mixed precision and autocast's weight
cache, by hand and against one process's measured forward.

Under ZeRO-2/3 with a 16-bit compute dtype, lmforge applies FSDP2's ``MixedPrecisionPolicy``: parameters are
gathered in the compute dtype and each block's floating inputs (its residual input, the RoPE tables) are cast
to it, so the residual stream is 16-bit, no weight is cast, q/k/v read one input and the MLP's input
projections another, and each block's RoPE tables are copied once (not once per q and k). The expected
figures here are worked out by hand from the model's shapes; the 2-process measurement of the same is
tests/test_estimate_fsdp_activations.py.

Under plain autocast (one process, DDP, ZeRO-1) autocast's cache keeps each checkpointed block's 16-bit
weight copies, and every block's bias copies, until the forward's autocast exits: measured here at the end
of forward against the formula's ``forward_casts``.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model.fused_loss import precomputes
from lmforge.model.loss import NextTokenLoss
from lmforge.parallel.apply import ApplyContext, activation_checkpointing
from lmforge.plan import hardware
from lmforge.plan.activations import activation_bytes
from lmforge.plan.estimate import Layout, Workload, estimate
from lmforge.probes.activation_memory import StorageTracker, saved_activation_bytes
from tests.conftest import model_of

B, T, V, CHUNK = 2, 32, 96, 8
N = B * T
C = 2  # BF16
LLAMA = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96)  # e = 16, g = 2, f = 96
GPT2 = ModelConfig(arch="gpt2", n_layers=3, d_model=64, n_heads=4, d_ff=128, tie_embeddings=False)


def acts(model: ModelConfig, policy: str, compute_bytes: int = C, mp: bool = True):
    return activation_bytes(model, V, T, B, policy, compute_bytes, "flash", CHUNK, fsdp_mixed_precision=mp)


def test_the_loss_keeps_its_input_in_these_shapes():
    """The head figures below assume the fused loss recomputes (keeps its input, not its gradients)."""
    assert not precomputes(N, V, 64, CHUNK, C)


def test_llama_block_under_fsdp_mixed_precision_by_hand():
    """d = 64, h = 4, g = 2, e = 16, f = 96, N = 64, T = 32, c = 2, two blocks, no checkpointing."""
    d, L = 64, 2
    a, autocast = acts(LLAMA, "none"), acts(LLAMA, "none", mp=False)
    assert a.attention_proj == L * C * N * d  # q, k, v share the norm's 16-bit output: 8192 a block
    assert autocast.attention_proj == L * 3 * C * N * d  # autocast casts it once per projection
    assert a.mlp == L * (C * N * d + 4 * C * N * 96)  # one shared input, gate, silu, up, product
    assert autocast.mlp == L * (2 * C * N * d + 4 * C * N * 96)
    assert a.rotary == L * 2 * C * T * 16  # cos, sin cast once by FSDP2 (the block's inputs): 2048 a block
    assert autocast.rotary == L * 4 * C * T * 16  # cast for q and again for k
    # the CPU RMSNorm upcasts its 16-bit input and saves that FP32 copy, its rstd and its FP32 x_hat
    assert a.residual == L * 2 * 4 * N * d and a.norms == L * 2 * (4 * N + 4 * N * d)
    assert a.weight_casts == 0 and a.forward_casts == 0  # parameters are gathered in BF16: nothing cast
    assert a.attention_kernel == autocast.attention_kernel == L * (4 * C * B * 4 * T * 16 + 4 * B * 4 * T)
    assert a.head == 4 * N * d + (4 * N + 4 * N * d) + C * N * d  # final norm, then its 16-bit output
    assert autocast.head == 4 * N * d + (4 * N + 4 * N * d) + 4 * N * d  # there its FP32 output
    gap = autocast.total - autocast.weight_casts - a.total
    assert gap == L * (3 * C * N * d + 2 * C * T * 16) + (4 - C) * N * d


def test_gpt2_block_under_fsdp_mixed_precision_by_hand():
    """LayerNorm on the CPU saves its 16-bit input and returns mean and rstd in that dtype."""
    d, f, L = 64, 128, 3
    a = acts(GPT2, "none")
    assert a.residual == L * 2 * C * N * d  # the two norms' inputs, 16-bit
    assert a.norms == L * 2 * (2 * C * N)  # mean and rstd per norm, 16-bit
    assert a.attention_proj == L * C * N * d and a.mlp == L * (C * N * d + 2 * C * N * f)
    assert a.rotary == 0 and a.weight_casts == 0
    assert a.head == C * N * d + 2 * C * N + C * N * d
    assert a.embedding == 8 * T


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_checkpointed_blocks_under_fsdp_mixed_precision_keep_a_16bit_input_and_the_rope_copies(model):
    L, d = model.n_layers, 64
    full, selective = acts(model, "full"), acts(model, "selective")
    rope = 2 * C * T * 16 if model.arch == "llama" else 0
    assert full.residual == selective.residual == L * C * N * d
    assert full.rotary == selective.rotary == L * rope
    assert full.attention_mask == B * T * T  # the boolean mask, once
    assert (full.attention_proj, full.mlp, full.norms, full.weight_casts) == (0, 0, 0, 0)


def test_fsdp_mixed_precision_changes_nothing_in_fp32():
    for model in (LLAMA, GPT2):
        for policy in ("none", "full", "selective", "every:2"):
            assert acts(model, policy, 4, mp=True) == acts(model, policy, 4, mp=False)


def test_forward_casts_by_hand():
    """GPT-2, d = 64, f = 128, three blocks, ``every:2`` (blocks 0 and 2 checkpointed): a block's matmul
    weights are 4 d^2 + 2 d f = 32768 values, its biases 4 d + f + d = 448."""
    a = acts(GPT2, "every:2", mp=False)
    assert a.forward_casts == C * (2 * 32768 + 3 * 448)
    assert acts(GPT2, "none", mp=False).forward_casts == C * 3 * 448  # no checkpoint: the biases only
    # llama: q and o 64 x 64, k and v 64 x 32 (two of four heads), gate, up and down 64 x 96; two blocks
    assert acts(LLAMA, "full", mp=False).forward_casts == C * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96)
    assert acts(LLAMA, "none", mp=False).forward_casts == 0  # llama has no biases
    assert acts(GPT2, "every:2", mp=True).forward_casts == 0  # nothing is cast under FSDP2's policy
    assert acts(GPT2, "every:2", 4, mp=False).forward_casts == 0  # nor in FP32
    assert a.peak == a.total + max(a.recompute, a.forward_casts)


@pytest.mark.parametrize("policy", ["none", "full", "every:2", "selective"])
@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_autocast_cache_at_the_end_of_forward_is_the_formulas_forward_casts(model: ModelConfig, policy: str):
    """One process, BF16 autocast: the storages the forward created that are alive just before its autocast
    exits (its graph held, its outputs dropped) exceed what backward keeps by exactly ``forward_casts``."""
    torch.manual_seed(0)
    net = model_of(model, V, T)
    activation_checkpointing(
        net, net, ApplyContext(TrainConfig(activation_checkpointing=policy), torch.device("cpu"))
    )
    objective = NextTokenLoss(net, CHUNK)
    ids = torch.randint(0, V, (B, T))
    docs = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
    tracker = StorageTracker()
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        out = objective(ids, ids, docs)
        graph = [t.grad_fn for t in out if t.grad_fn is not None]
        del out
        gc.collect()
        at_end_of_forward = tracker.alive_bytes()
    del graph

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return objective(ids, ids, docs)

    saved = saved_activation_bytes(forward)
    a = acts(model, policy, mp=False)
    assert saved == a.total
    assert at_end_of_forward - saved == a.forward_casts


@pytest.mark.parametrize(
    ("layout", "mp"),
    [
        (Layout(dp_shard=2, zero=3), True),
        (Layout(dp_shard=2, zero=2), True),
        (Layout(dp_replicate=2, dp_shard=2, zero=3), True),  # hybrid sharding: FSDP2 on a 2-D mesh
        (Layout(dp_shard=2, zero=1), False),  # DDP + ZeroRedundancyOptimizer: autocast
        (Layout(dp_replicate=2), False),
        (Layout(), False),
    ],
    ids=["zero3", "zero2", "hsdp", "zero1", "ddp", "one"],
)
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp8"])
def test_estimate_applies_fsdp_mixed_precision_where_fsdp2_computes_in_16_bits(layout, mp, precision):
    """The estimate's activations row takes FSDP2's mixed precision under ZeRO-2/3 (FP8 too: its policy
    computes in BF16) and autocast elsewhere (where FP8's float8 layers take no autocast weight copies);
    a transient on top: the larger of the recomputation and the autocast cache."""
    w = Workload(LLAMA, V, T, precision=precision, loss_chunk=CHUNK, device_type="cpu")
    layout = replace(layout, micro_batch=B, activation_checkpointing="every:2")
    flops = dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8"), 1e11)
    hw = hardware.Hardware("cpu", 2**36, flops, 1e10, 1e10, "test")
    e = estimate(w, layout, hw)
    a = activation_bytes(
        LLAMA, V, T, B, "every:2", C, "flash", CHUNK, fsdp_mixed_precision=mp, fp8=precision == "fp8"
    )
    assert e.activation_parts["attention_proj"] == a.attention_proj == (C if mp else 3 * C) * N * 64
    assert e.activations == a.total + max(a.recompute, a.forward_casts)
