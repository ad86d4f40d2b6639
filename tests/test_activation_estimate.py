"""The planner's activation-memory formula (lmforge/plan/activations.py) against the bytes a real forward
keeps alive for backward (lmforge/probes/activation_memory.py: storages created by the forward and still
held by its graph, checkpoint frames included). The two are independent: the formula is arithmetic on the
config, the measurement runs lmforge's model, loss and checkpointing stage on the CPU and counts storages.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lmforge.config import ModelConfig, TrainConfig
from lmforge.model.attention import attend, document_causal_mask
from lmforge.model.fused_loss import precomputes
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import keep_stage
from lmforge.parallel.apply import ApplyContext, activation_checkpointing
from lmforge.plan.activations import activation_bytes, attention_kind
from lmforge.probes.activation_memory import saved_activation_bytes
from tests.conftest import model_of

# The planner's requirement is 10%; the formula is exact on this torch (2.13), so the tests ask for the
# exact byte count: a tolerance would let the small parts (the log-sum-exp, RoPE's casts, the per-chunk
# loss weights) go wrong unnoticed. An op-level change in a later torch shows here first.
TOLERANCE = 0.0
# The loss these tests measure: lmforge.model.loss's NextTokenLoss computes the fused linear +
# cross-entropy (model/fused_loss.py), the planner's default.
MEASURED_LOSS = "fused"
POLICIES = ("none", "full", "every:2", "selective")


@dataclass(frozen=True)
class Shape:
    name: str
    model: ModelConfig
    vocab: int
    seq: int
    batch: int
    chunk: int


def shape(name: str, vocab: int, seq: int, batch: int, chunk: int, **model) -> Shape:
    return Shape(name, ModelConfig(**model), vocab, seq, batch, chunk)


# (vocab, seq_len, micro_batch, loss_chunk) and the model: arch, depth, width, heads, GQA / MQA, tied or
# untied head, document mask on or off, one loss chunk (0) or several (uneven last chunk included)
SHAPES = [
    shape("llama-gqa-doc", 96, 32, 2, 24, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2),
    shape("gpt2-untied", 80, 40, 3, 0, arch="gpt2", n_layers=3, d_model=48, n_heads=4, doc_mask=False,
          tie_embeddings=False),
    shape("llama-mha-untied", 128, 48, 1, 16, n_layers=3, d_model=96, n_heads=6, doc_mask=False,
          tie_embeddings=False),
    shape("gpt2-gqa-doc", 64, 64, 2, 100, arch="gpt2", n_layers=2, d_model=64, n_heads=8, n_kv_heads=2),
    shape("llama-deep-mqa", 50, 24, 4, 32, n_layers=5, d_model=32, n_heads=4, n_kv_heads=1, d_ff=80),
    shape("llama-wide-doc", 256, 96, 1, 0, n_layers=1, d_model=128, n_heads=2, tie_embeddings=False),
    shape("gpt2-long-tied", 40, 128, 2, 64, arch="gpt2", n_layers=4, d_model=32, n_heads=2, doc_mask=False),
]  # fmt: skip


def measure(shape: Shape, policy: str, autocast: bool = False, math: bool = False, stage=None) -> int:
    """Bytes the forward of lmforge's training objective keeps alive for backward (CPU, eager)."""
    torch.manual_seed(0)
    model = model_of(shape.model, shape.vocab, shape.seq)
    if stage is not None:
        keep_stage(model, stage)
    train = TrainConfig(activation_checkpointing=policy, compile=False)
    activation_checkpointing(model, model, ApplyContext(train=train, device=torch.device("cpu")))
    b, t = shape.batch, shape.seq
    ids = torch.randint(0, shape.vocab, (b, t))
    targets = torch.randint(0, shape.vocab, (b, t))
    doc_ids = (torch.arange(t) >= t // 3).long().expand(b, t).contiguous()  # two documents per row
    hidden = torch.randn(b, t, shape.model.d_model)
    objective = NextTokenLoss(model, shape.chunk)
    precision = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    kernel = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()

    def forward():
        with precision, kernel:
            if stage is None:
                return objective(ids, targets, doc_ids)
            if model.embed is None:  # a later stage receives its input into a fresh buffer
                x = hidden.clone().requires_grad_()
                return objective(x, targets, doc_ids) if model.lm_head is not None else model(x, doc_ids)
            return model(ids, doc_ids)

    return saved_activation_bytes(forward)


def predict(shape: Shape, policy: str, compute_bytes: int = 4, attention: str = "flash", **kw) -> int:
    return activation_bytes(
        shape.model,
        shape.vocab,
        shape.seq,
        shape.batch,
        policy,
        compute_bytes,
        attention,
        shape.chunk,
        loss=MEASURED_LOSS,
        **kw,
    ).total


def check(predicted: int, measured: int) -> None:
    assert measured > 0
    error = (predicted - measured) / measured
    assert abs(error) <= TOLERANCE, f"predicted {predicted} B, measured {measured} B ({error:+.2%})"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_fp32_formula_matches_measured(shape: Shape, policy: str):
    check(predict(shape, policy), measure(shape, policy))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=lambda s: s.name)
def test_bf16_autocast_formula_matches_measured(shape: Shape, policy: str):
    check(predict(shape, policy, compute_bytes=2), measure(shape, policy, autocast=True))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=lambda s: s.name)
def test_math_attention_formula_matches_measured(shape: Shape, policy: str, autocast: bool):
    """SDPA's math fallback (forced): O(T^2) probabilities saved, no additive mask; on CPU it computes
    in FP32 even under autocast."""
    compute_bytes = 2 if autocast else 4
    predicted = predict(shape, policy, compute_bytes, attention="math")
    check(predicted, measure(shape, policy, autocast=autocast, math=True))


@pytest.mark.parametrize("policy", ["none", "every:2"])
@pytest.mark.parametrize("layers", [range(0, 2), range(2, 5), range(1, 4)], ids=["first", "last", "middle"])
def test_pipeline_stage_formula_matches_measured(layers: range, policy: str):
    """A stage's blocks (``every:2`` counts by the block's index in the whole model); the embedding only
    on the first stage, the final norm, head and loss only on the last."""
    shape = SHAPES[4]
    predicted = predict(shape, policy, layers=len(layers), first_layer=layers.start)
    check(predicted, measure(shape, policy, stage=layers))


def test_policies_order_and_parts():
    """Checkpointing saves less than none, the loss holds every chunk's log-probabilities (4 N V whatever
    the chunk), and GQA does not shrink the saved K/V of SDPA (repeated to n_heads before the kernel)."""
    shape = SHAPES[0]
    args = (shape.model, shape.vocab, shape.seq, shape.batch)
    none, full = (activation_bytes(*args, p, 4, "flash", shape.chunk) for p in ("none", "full"))
    assert full.total < none.total and full.recompute > 0 and none.recompute == 0
    for chunk in (0, 7, 64):
        tokens = shape.batch * shape.seq
        chunks = math.ceil(tokens / (chunk or tokens))
        loss = activation_bytes(*args, "none", 4, "flash", chunk, loss="chunked").loss
        assert loss == 4 * tokens * shape.vocab + 4 * chunks
    mha = shape.model.model_copy(update={"n_kv_heads": None})
    assert activation_bytes(mha, *args[1:], "none", 4, "flash", 0).attention_kernel == none.attention_kernel
    flex = activation_bytes(*args, "none", 4, "flex", 0)
    assert flex.attention_kernel < none.attention_kernel and flex.attention_mask == 0
    # CUDA's fused RMSNorm keeps no x * rstd: 4 N d bytes less per norm (two per block and the final one)
    cuda = activation_bytes(*args, "none", 4, "flash", shape.chunk, device_type="cuda")
    tokens, norms = shape.batch * shape.seq, 2 * shape.model.n_layers + 1
    assert none.total - cuda.total == norms * 4 * tokens * shape.model.d_model


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_loss_keeps_its_input_or_its_gradients_and_no_logits(tp: int):
    """The fused head + cross-entropy keeps, recomputing, its input (the final norm's FP32 output, ``4 N
    d``, whole on every TP rank) and one FP32 log-sum-exp per token (``4 N``); precomputing (where
    ``model/fused_loss.py::precomputes`` says so), the FP32 gradients of the hidden states and of this
    rank's head rows (``4 N d + 4 V d / tp``). Never logits or a weight cast (the chunked loss kept the
    head input, the head's autocast copy and every token's log-probabilities). By hand for SHAPES[4]
    (llama, d 32, 5 layers, batch 4 x 24 = 96 tokens, vocab 50), where both ways occur without TP."""
    shape = SHAPES[4]
    args = (shape.model, shape.vocab, shape.seq, shape.batch, "none")
    tokens, d, vocab, layers = 96, 32, 50, 5
    n = tokens // tp  # the sequence-parallel final norm
    final_norm = 4 * n * d + (4 * n + 4 * n * d)  # input 4 n d, rstd 4 n and x_hat 4 n d (CPU RMSNorm)
    ways = set()
    for chunk in (0, 7, 32):
        for c in (4, 2):
            fused = activation_bytes(*args, c, "flash", chunk, tp=tp, loss="fused")
            chunked = activation_bytes(*args, c, "flash", chunk, tp=tp, loss="chunked")
            precomputing = precomputes(tokens, vocab // tp, d, chunk, c)
            ways.add(precomputing)
            if precomputing:
                assert (fused.head, fused.loss) == (final_norm, 4 * tokens * d + 4 * (vocab // tp) * d)
            else:
                assert (fused.head, fused.loss) == (final_norm + 4 * tokens * d, 4 * tokens)
            chunks = math.ceil(tokens / (chunk or tokens))
            assert chunked.loss == 4 * tokens * vocab + 4 * chunks
            blocks = activation_bytes(*args, c, "flash", chunk, tp=tp, loss="fused", layers=1)
            assert fused.weight_casts == layers * blocks.weight_casts  # the blocks' casts, no head cast
            assert chunked.weight_casts - fused.weight_casts == (2 * vocab * d // tp if c == 2 else 0)
    assert ways == ({True, False} if tp == 1 else {False})  # V / 2 rows: the gradients outweigh a chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("doc_mask", [False, True])
def test_cpu_attention_kernel_is_flash(dtype: torch.dtype, doc_mask: bool):
    """lmforge's CPU path (``attend``: is_causal, or the boolean document mask) runs SDPA's CPU flash
    kernel, which saves q, k, v, out and the log-sum-exp (plus the mask, converted to the compute dtype):
    what :func:`attention_kind` reports for a CPU run."""
    assert attention_kind("cpu", "auto", doc_mask) == "flash"
    b, h, t, e = 2, 4, 16, 8
    q, k, v = (torch.randn(b, h, t, e, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = document_causal_mask((torch.arange(t) >= 5).long().expand(b, t)) if doc_mask else None
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = attend(q, k[:, :2], v[:, :2], mask=mask)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    shapes = sorted(tuple(x.shape) for x in saved)
    expected = [(b, h, t), *[(b, h, t, e)] * 4] + ([(b, 1, t, t)] if doc_mask else [])
    assert shapes == sorted(expected)  # k and v saved n_heads wide after repeat_interleave


def test_attention_kind_of_a_run():
    assert attention_kind("cuda", "auto", True) == "flex"
    assert attention_kind("cuda", "auto", False) == "flash"
    assert attention_kind("cuda", "sdpa", True) == "flash"
    assert attention_kind("cpu", "flex", True) == "flex"
    with pytest.raises(ValueError, match="attention"):
        activation_bytes(SHAPES[0].model, 96, 32, 2, "none", 4, "eager", 0)
    with pytest.raises(ValueError, match="policy"):
        activation_bytes(SHAPES[0].model, 96, 32, 2, "some", 4, "flash", 0)
