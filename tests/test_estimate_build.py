"""The planner's sharded build, FSDP2's accumulation controls, the fused loss's terms and the memory limit
that refuses a run (``plan/memory.py::build_bytes``, ``plan/comm.py``, ``plan/limit.py``).

Expected values are counted by hand from the model's shapes (the docstrings say how); the build's peaks
are also measured against PyTorch's ``MemTracker`` on real multi-process builds (``-m distributed``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.fused_loss import precomputes
from lmforge.plan import comm, hardware, models
from lmforge.plan.estimate import Layout, Workload, estimate
from lmforge.plan.limit import check_memory, planned_peak
from lmforge.plan.memory import build_bytes, loss_temporary, param_count, param_tensors, stage_tensors
from lmforge.recipe import load_config
from tests.torchrun import torchrun, worker

H100 = hardware.get("h100-80gb")
GIB = 2**30

# A tiny Llama counted by hand: per block q, k, v, o (64 x 64), gate and up (128 x 64), down (64 x 128),
# two norms of 64; an untied 1000 x 64 embedding and head, a final norm.
MODEL = ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, d_ff=128, tie_embeddings=False)
V, T = 1000, 32
BLOCK = 4 * 64 * 64 + 3 * 128 * 64 + 2 * 64  # 41,088
EMBED = V * 64  # 64,000 (the head too)
P = 2 * BLOCK + 2 * EMBED + 64  # 210,240
ROPE = 2 * 4 * T * (64 // 4)  # the RoPE cos / sin tables, FP32 (T x head dim each): not planned


# Tolerances: the planner is float64 arithmetic on Python numbers (no tensor, nothing CPU-dependent), so
# pytest.approx's default (1e-6 relative) and rel=1e-12 only absorb the same formula's rounding in another
# order (~1e-16 relative).


def _work(**kw) -> Workload:
    return Workload(MODEL, V, T, **{"precision": "fp32", "loss_chunk": 16, **kw})


def test_the_model_is_counted_by_hand():
    assert param_count(MODEL, V, T) == P == 210_240


# (layout, per pipeline rank: (FP32 parameters, the largest temporary, DDP buckets) in bytes), by hand:
# * one process, DDP, ZeRO-1: the whole replica 4P in place; DDP's buckets 4P more;
# * FSDP2 over 2: 4P / 2, and the embedding (the largest) drawn whole plus its clone of 500 rows;
# * TP 2: per block q, k, v 32 x 64, o 64 x 32, gate, up 64 x 64, down 64 x 64, norms whole (20,608),
#   embedding and head 500 x 64: 105,280 values; the embedding whole plus its 500-row cut;
# * FSDP2 2 x TP 2: half of that; the embedding's FSDP2 placement on the TP shard is a _StridedShard,
#   which assembles every piece (a whole copy) before cloning its 500 rows: 2 x 64,000 + 32,000;
# * a pipeline of 2 stages: stage 0 the embedding and block 0, stage 1 block 1, the norm and the head;
#   each draws the other's 64,000-value matrix whole to keep the random stream;
# * FSDP2 2 x a pipeline of 2: half of each stage; its own matrix whole plus its clone.
BUILDS = [
    (Layout(), [(4 * P, 0, 0)]),
    (Layout(dp_replicate=2), [(4 * P, 0, 4 * P)]),
    (Layout(dp_shard=2, zero=1), [(4 * P, 0, 4 * P)]),
    (Layout(dp_shard=2, zero=3), [(2 * P, 4 * (EMBED + 32_000), 0)]),
    (Layout(dp_shard=2, zero=2), [(2 * P, 4 * (EMBED + 32_000), 0)]),
    (Layout(tp=2), [(4 * 105_280, 4 * (EMBED + 32_000), 0)]),
    (Layout(dp_shard=2, tp=2), [(2 * 105_280, 4 * (2 * EMBED + 32_000), 0)]),
    (
        Layout(pp=2, micro_batch=2),
        [(4 * (EMBED + BLOCK), 4 * EMBED, 0), (4 * (BLOCK + 64 + EMBED), 4 * EMBED, 0)],
    ),
    (
        Layout(dp_shard=2, pp=2, micro_batch=2),
        [(2 * (EMBED + BLOCK), 4 * (EMBED + 32_000), 0), (2 * (BLOCK + 64 + EMBED), 4 * (EMBED + 32_000), 0)],
    ),
]


def _stage(rank: int, pp: int) -> list:
    tensors = param_tensors(MODEL, V, T)
    return tensors if pp == 1 else stage_tensors(tensors, range(rank, rank + 1), 2)


@pytest.mark.parametrize(
    ("layout", "ranks"), BUILDS, ids=lambda x: x.describe() if isinstance(x, Layout) else ""
)
def test_build_peak_per_layout(layout: Layout, ranks: list):
    whole = param_tensors(MODEL, V, T)
    for rank, (shards, temporary, buckets) in enumerate(ranks):
        b = build_bytes(whole, _stage(rank, layout.pp), layout.kind, layout.dp_shard, layout.tp)
        assert (b.shards, b.temporary, b.ddp_buckets) == (shards, temporary, buckets), rank
    # the estimate reports every rank's build with the framework's overhead (GPU: 1 GiB + 5%)
    e = estimate(_work(tokens_per_step=layout.micro_batch * T * layout.dp), layout, H100)
    want = [(s + t + b) * 1.05 + GIB for s, t, b in ranks]
    # float64 byte counts: see the Tolerances note at the top (rel 1e-12 against ~1e-16 rounding)
    assert e.pp_rank_build_totals == pytest.approx(want, rel=1e-12)
    assert e.build_total == pytest.approx(max(want), rel=1e-12) and e.peak >= e.build_total


def test_llama_65b_on_64_gpus_reports_the_sharded_build():
    """LLaMA 65B (65,285,660,672 parameters, every dimension divisible by 64) under ZeRO-3 over 64 H100s:
    each rank builds 4P / 64 bytes of FP32 shards and draws the 32,000 x 8,192 embedding (or head) whole,
    plus its 500-row clone, never the whole 261 GB model."""
    named = models.get("llama-65b")
    p = 65_285_660_672
    e = estimate(Workload(named.model, named.vocab_size, named.seq_len), Layout(dp_shard=64), H100)
    assert e.n_params == p
    assert e.build.shards == 4 * p / 64 == 4_080_353_792
    assert e.build.temporary == 4 * 32_000 * 8_192 * (1 + 1 / 64) == 1_064_960_000
    assert e.build.ddp_buckets == 0
    # approx default rel 1e-6 on float64 byte counts: see the Tolerances note at the top
    assert e.build_total == pytest.approx((4_080_353_792 + 1_064_960_000) * 1.05 + GIB)
    assert e.peak_source == "step" and e.peak == e.total > e.build_total  # activations of 2,048 tokens


def test_cli_shows_the_build_in_text_and_json(estimate_command):
    args = ("--model", "llama-65b", "--gpus", "64", "--parallel.dp_shard=64")
    code, text, err = estimate_command(*args)
    assert code == 0, err
    build = (4_080_353_792 + 1_064_960_000) * 1.05 + GIB
    line = next(x for x in text.splitlines() if x.strip().startswith("build"))
    assert (
        f"{build / GIB:.2f}" in line
        and "FP32 parameters 3.80" in line
        and "largest whole parameter 0.99" in line
    )
    code, text, err = estimate_command(*args, "--json")
    assert code == 0, err
    e = json.loads(text)["estimate"]
    assert e["build"] == {"shards": 4_080_353_792, "temporary": 1_064_960_000, "ddp_buckets": 0}
    # approx default rel 1e-6: the JSON's float64 byte count, see the Tolerances note at the top
    assert e["build_total"] == pytest.approx(build) and e["peak_source"] == "step"
    assert e["peak"] == e["total"]


# A tied 131,072 x 1,024 embedding and one small block over 32 FSDP2 ranks x 2 TP ranks: the shards are
# tiny, and FSDP2's _StridedShard over the TP shard costs the embedding twice over while it is drawn,
# 1 GiB; a training step of 64 tokens (the fused loss keeps the head's half-vocabulary FP32 gradient,
# 256 MiB) holds less.
WIDE = ModelConfig(arch="llama", n_layers=1, d_model=1024, n_heads=8, d_ff=2048)
WIDE_P = 131_072 * 1024 + (4 * 1024 * 1024 + 3 * 2048 * 1024 + 2 * 1024) + 1024  # 144,706,560
# per TP rank: embedding 65,536 x 1,024; q, k, v 512 x 1,024, o 1,024 x 512, gate, up, down 1,024 x 1,024,
# two norms and the final norm whole: 72,354,816 values; a 32nd of them on each rank (all divide)
WIDE_SHARDS = 4 * (65_536 * 1024 + 4 * 512 * 1024 + 3 * 1024 * 1024 + 3 * 1024) // 32  # 9,044,352
WIDE_BUILD = WIDE_SHARDS + 4 * (2 * 131_072 * 1024 + 131_072 * 1024 // 32)  # 1,099,563,392


def test_the_build_can_set_the_peak_and_the_estimate_says_so():
    work = Workload(WIDE, 131_072, 64, "bf16", "adamw", "flash", 64, None, "cuda")
    e = estimate(work, Layout(dp_shard=32, tp=2), H100)
    assert param_count(WIDE, 131_072, 64) == WIDE_P
    assert e.build.total == WIDE_BUILD == 1_099_563_392 and e.build.shards == WIDE_SHARDS
    # approx default rel 1e-6 on float64 byte counts: see the Tolerances note at the top
    assert e.peak_source == "build" and e.peak == e.build_total == pytest.approx(WIDE_BUILD * 1.05 + GIB)
    assert e.build_total > e.total
    (warning,) = [w for w in e.warnings if "build" in w]
    assert warning.startswith("the build sets the peak") and "\n" not in warning
    assert f"{e.build_total / GIB:.2f} GiB" in warning and f"{e.total / GIB:.2f} GiB" in warning
    # fits compares the peak, the build's here: a margin the step meets but the build does not
    between = (e.total + e.build_total) / 2 / H100.memory_bytes
    assert not estimate(work, Layout(dp_shard=32, tp=2), H100, margin=between).fits
    # FSDP2 alone over 64: the embedding drawn once (+ its clone), under the step, which keeps the
    # fused loss's backward with its whole-vocabulary FP32 head gradient (512 MiB)
    alone = estimate(work, Layout(dp_shard=64), H100)
    assert alone.build.temporary == 4 * 131_072 * 1024 * (1 + 1 / 64) and alone.peak_source == "step"


def test_no_warning_where_training_sets_the_peak():
    e = estimate(_work(), Layout(dp_replicate=2), H100)
    assert e.peak_source == "step" and not any("build" in w for w in e.warnings)


# -- FSDP2's accumulation controls ----------------------------------------------------------------------

ACCUM = 4  # micro-batches per step and rank


def _accumulating(layout: Layout):
    return estimate(_work(tokens_per_step=ACCUM * T * layout.dp), layout, H100)


@pytest.mark.parametrize("zero", [2, 3])
def test_defer_grad_sync_keeps_unsharded_fp32_gradients_and_reduces_once(zero: int):
    """Over 4 ranks, 4 micro-batches a step, FP32: the gradients while micro-batches accumulate are the
    whole model's unsharded FP32 gradients, 4P, instead of FSDP2's shards, 4P / 4; the reduce-scatters
    fall from 4 to 1 per step, which removes 3 x (3/4) x 4P bytes of traffic."""
    plain = _accumulating(Layout(dp_shard=4, zero=zero))
    deferred = _accumulating(Layout(dp_shard=4, zero=zero, defer_grad_sync=True))
    assert plain.accum == deferred.accum == ACCUM
    assert plain.peak_phase.endswith(", gradients accumulating") and plain.gradients_at_peak == 4 * P / 4
    assert deferred.peak_phase.endswith(", unsharded gradients accumulating")
    assert deferred.gradients_at_peak == 4 * P
    assert deferred.states == plain.states  # at rest (and in the optimizer step) the gradients are sharded
    # approx default rel 1e-6 on float64 byte counts: see the Tolerances note at the top
    assert deferred.total - plain.total == pytest.approx((4 * P - P) * 1.05)  # + the allocator's 5%
    assert plain.dp_collectives["reduce_scatter"] == ACCUM and deferred.dp_collectives["reduce_scatter"] == 1
    assert plain.comm.dp - deferred.comm.dp == pytest.approx(3 * 0.75 * 4 * P)
    assert plain.dp_collectives["all_gather"] == deferred.dp_collectives["all_gather"]


def test_zero2_gathers_once_per_step_and_zero3_for_every_forward_and_backward():
    z2 = _accumulating(Layout(dp_shard=4, zero=2))
    z3 = _accumulating(Layout(dp_shard=4, zero=3))
    assert z2.dp_collectives == {
        "all_gather": 1,
        "all_gather_forward": 1,
        "all_gather_backward": 0,
        "reduce_scatter": ACCUM,
    }
    assert z3.dp_collectives["all_gather_forward"] == z3.dp_collectives["all_gather_backward"] == ACCUM
    # bytes: one FP32 gather of P over 4 ranks, 4 reduce-scatters of the FP32 gradients
    # approx default rel 1e-6 on float64 byte counts: see the Tolerances note at the top
    assert z2.comm.dp == pytest.approx(0.75 * 4 * P * (1 + ACCUM))
    root = EMBED + 64  # the embedding and final norm, gathered once per micro-batch
    assert z3.comm.dp == pytest.approx(0.75 * 4 * (ACCUM * P + ACCUM * (P - root) + ACCUM * P))


def test_defer_grad_sync_changes_nothing_with_one_micro_batch():
    one = estimate(_work(), Layout(dp_shard=4), H100)
    deferred = estimate(_work(), Layout(dp_shard=4, defer_grad_sync=True), H100)
    assert one.accum == 1
    assert (deferred.total, deferred.comm, deferred.dp_collectives) == (
        one.total,
        one.comm,
        one.dp_collectives,
    )


def test_a_pipeline_stage_under_fsdp2_keeps_its_gradients_unsharded():
    """torch's schedule turns FSDP2's gradient sync off for every pipeline micro-batch until the step's
    reduce: the peak stage (stage 1: block 1, the final norm and the head, which also holds the loss's
    chunk) holds 4 (41,088 + 64 + 64,000) bytes of FP32 gradients, not half of them."""
    e = estimate(_work(tokens_per_step=2 * T * 2), Layout(dp_shard=2, pp=2, micro_batch=2), H100)
    assert e.pp_rank == 1 and e.peak_phase.endswith(", unsharded gradients accumulating")
    stage = BLOCK + 64 + EMBED
    assert e.gradients_at_peak == 4 * stage and e.states.grads == 2 * stage


def test_collective_counts():
    assert comm.dp_collectives("ddp", 8) == {"all_reduce": 1}
    assert comm.dp_collectives("zero1", 8) == {"all_reduce": 1, "broadcast": 1}
    assert comm.dp_collectives("zero2", 8, defer=True)["reduce_scatter"] == 1
    # a pipeline of 4 micro-batches: ZeRO-3 gathers for each; GPipe's backwards run back to back
    assert comm.dp_collectives("zero3", 2, pipeline_mb=4)["all_gather_backward"] == 8
    assert comm.dp_collectives("zero3", 2, pipeline_mb=4, schedule="gpipe")["all_gather_backward"] == 2
    assert comm.dp_collectives("zero2", 2, defer=True, pipeline_mb=4)["reduce_scatter"] == 2


# -- the fused loss ---------------------------------------------------------------------------------------


def test_fused_loss_temporaries_and_vocabulary_parallel_traffic():
    """A micro-batch of 32 tokens (d 64, V 1000), chunks of 16. The fused loss's forward holds one chunk's
    logits, their FP32 copy under autocast and the shifted exponentials; its backward the two new FP32
    gradients, 4 (N d + V d / tp), and the recomputed chunk with its softmax gradient (and under autocast
    its BF16 copy, or that copy and the BF16 product for the head's gradient); under autocast both make
    BF16 copies of the hidden states and of the head (under FSDP2 the head is BF16 already); the larger
    counts. The chunked loss held the chunk's 16-bit logits and their FP32 copy, all V columns on every TP
    rank. Under TP the fused loss moves the head's FP32 input (all-gathered), its gradient and 20 bytes of
    statistics per token (all-reduced), not the logits."""
    n, d = 32, 64
    assert loss_temporary("fused", 16, 1000, 1, 4, n, d) == 4 * (n * d + 1000 * d) + 4 * 16 * 1000 == 328_192
    assert loss_temporary("fused", 16, 1000, 2, 4, n, d) == 4 * (n * d + 500 * d) + 4 * 16 * 500 == 168_192
    casts = 2 * (n * d + 1000 * d)
    # the backward's gradients, and a chunk's FP32 logits and their BF16 gradient, or that gradient and its
    # BF16 product for the head's gradient
    backward = 4 * (n * d + 1000 * d) + max((2 + 4) * 16 * 1000, 2 * 16 * 1000 + 2 * 1000 * d)
    assert loss_temporary("fused", 16, 1000, 1, 2, n, d) == casts + backward == 556_288
    # under FSDP2 the gathered head is BF16 already: only the hidden states' copy
    assert loss_temporary("fused", 16, 1000, 1, 2, n, d, fsdp=True) == 2 * n * d + backward == 428_288
    # a narrow head (d 8): the two gradients (33,024 B) are no larger than a chunk's temporaries, so the
    # sum precomputes them (kept: activations); the larger is then the forward's chunk statistics
    assert precomputes(32, 1000, 8, 16, 4)
    assert loss_temporary("fused", 16, 1000, 1, 4, 32, 8) == max(8 * 16 * 1000, 4 * (32 * 8 + 1000 * 8))
    # chunks of 128 tokens (one micro-batch of 128, d 8, BF16): it precomputes too, and the forward's chunk
    # statistics (its FP32 logits and their exponentials) are the larger
    assert precomputes(128, 1000, 8, 128, 2)
    assert loss_temporary("fused", 128, 1000, 1, 2, 128, 8) == 2 * (128 * 8 + 1000 * 8) + 8 * 128 * 1000
    assert loss_temporary("chunked", 16, 1000, 2, 2) == (2 + 4) * 16 * 1000
    tokens, frac = 4096, 1 / 2
    blocks = comm.tp_volume(2, 2, tokens, d, 1000, 2, head=False)
    fused = comm.tp_volume(2, 2, tokens, d, 1000, 2, loss="fused")
    chunked = comm.tp_volume(2, 2, tokens, d, 1000, 2, loss="chunked")
    # the FP32 hidden states all-gathered, their FP32 gradient and 20 bytes of statistics per token
    # (the row maximum in FP32, the sum of exponentials and the target logit in FP64) all-reduced
    # approx default rel 1e-6 on float64 byte counts: see the Tolerances note at the top
    assert fused - blocks == pytest.approx(
        frac * 4 * tokens * d + 2 * frac * 4 * tokens * d + 2 * frac * 20 * tokens
    )
    assert chunked - blocks == pytest.approx(2 * frac * tokens * 1000 * 2)
    e = estimate(_work(), Layout(), H100)  # FP32, one micro-batch of 32 tokens, chunks of 16
    assert e.temporaries.loss_chunk == 328_192
    assert e.activation_parts["loss"] == 4 * T


# -- the memory limit ---------------------------------------------------------------------------------------


def _cfg(**over):
    base = {"model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.d_ff": 128}
    base |= {
        "model.tie_embeddings": False,
        "data.vocab_size": V,
        "data.seq_len": T,
        "train.precision": "fp32",
    }
    return load_config(None, {**base, **over})


def test_limit_passes_a_fitting_layout_and_refuses_one_over_it_in_one_line():
    cfg = _cfg()
    peak = planned_peak(cfg, 1, "cpu", "fp32").peak
    assert peak > 0.5 * GIB  # the CPU runtime alone is 0.5 GiB
    fits = _cfg(**{"parallel.max_memory_gb": peak / 1e9 * 1.001})
    assert check_memory(fits, 1, "cpu", "fp32").peak == peak
    tight = _cfg(**{"parallel.max_memory_gb": peak / 1e9 * 0.999})
    with pytest.raises(ConfigError) as err:
        check_memory(tight, 1, "cpu", "fp32")
    text = str(err.value)
    assert "\n" not in text and text.startswith("parallel.max_memory_gb: the planned peak per device is")
    assert (
        f"{peak / 1e9:.2f} GB, set by a training step" in text and "--train.activation_checkpointing" in text
    )
    assert check_memory(cfg, 1, "cpu", "fp32") is None  # CPU without the key: nothing checked


def test_limit_names_the_build_when_the_build_is_the_peak():
    """The wide model over 32 x 2 ranks (the build sets its peak, by hand: 1,099,563,392 bytes x 1.05 +
    1 GiB) against a 1.5 GB limit."""
    cfg = load_config(
        None,
        {
            "model.n_layers": 1, "model.d_model": 1024, "model.n_heads": 8, "model.d_ff": 2048,
            "data.vocab_size": 131_072, "data.seq_len": 64, "train.loss_chunk": 64,
            "train.micro_batch_size": 1, "train.tokens_per_step": 64 * 64,
            "parallel.dp_shard": 32, "parallel.tp": 2, "parallel.max_memory_gb": 1.5,
        },
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, 64, "cuda", "bf16")
    text = str(err.value)
    build = WIDE_BUILD * 1.05 + GIB
    assert f"is {build / 1e9:.2f} GB, set by the build" in text and "over the limit of 1.50 GB" in text
    assert "--parallel.dp_shard" in text and "\n" not in text


def test_limit_on_cuda_defaults_to_the_device_memory():
    cfg = _cfg()
    peak = planned_peak(cfg, 1, "cuda", "bf16").peak
    assert check_memory(cfg, 1, "cuda", "bf16", device_memory=int(peak) + 1).peak == peak
    with pytest.raises(ConfigError, match=r"^parallel\.max_memory_gb: .*the device's memory; "):
        check_memory(cfg, 1, "cuda", "bf16", device_memory=int(peak) - 1)


def test_limit_is_not_checked_for_offloaded_runs_and_says_so_when_asked():
    """The planner counts every state and activation on the device, which offloading moves to the host."""
    for key in ("parallel.offload", "train.activation_offload"):
        assert check_memory(_cfg(**{key: True}), 1, "cuda", "bf16", device_memory=1) is None
        with pytest.raises(ConfigError, match=rf"^parallel\.max_memory_gb: .*not model {key}.*remove"):
            check_memory(_cfg(**{key: True, "parallel.max_memory_gb": 1.0}), 1, "cuda", "bf16")
    # a float64 verification run: 8 bytes a value where the plan counts 4
    fp64 = {"train.precision": "fp64"}
    assert check_memory(_cfg(**fp64), 1, "cuda", "fp32", device_memory=1) is None
    with pytest.raises(ConfigError, match=r"^parallel\.max_memory_gb: .*not model train\.precision=fp64"):
        check_memory(_cfg(**fp64, **{"parallel.max_memory_gb": 1.0}), 1, "cuda", "fp32")
    # selective checkpointing of Mixture-of-Experts blocks: which of their ops it keeps is not modelled
    moe = {"model.moe.experts": 4, "train.activation_checkpointing": "selective"}
    assert check_memory(_cfg(**moe), 1, "cuda", "fp32", device_memory=1) is None
    with pytest.raises(ConfigError, match=r"^parallel\.max_memory_gb: .*not model train\.activation_check"):
        check_memory(_cfg(**moe, **{"parallel.max_memory_gb": 1.0}), 1, "cuda", "fp32")


def test_limit_is_checked_for_moe_runs():
    """An MoE run is planned (its experts, routing and dispatch buffers) and checked like a dense one."""
    cfg = _cfg(**{"model.moe.experts": 4})
    peak = planned_peak(cfg, 1, "cuda", "bf16").peak
    assert peak > planned_peak(_cfg(), 1, "cuda", "bf16").peak  # four experts hold more than one MLP
    assert check_memory(cfg, 1, "cuda", "bf16", device_memory=int(peak) + 1).peak == peak
    with pytest.raises(ConfigError, match=r"^parallel\.max_memory_gb: .*the device's memory; "):
        check_memory(cfg, 1, "cuda", "bf16", device_memory=int(peak) - 1)


def test_limit_plans_auto_micro_batch_at_its_smallest_candidate():
    auto = _cfg(**{"train.micro_batch_size": "auto", "train.tokens_per_step": 8 * T})
    one = _cfg(**{"train.micro_batch_size": 1, "train.tokens_per_step": 8 * T})
    assert planned_peak(auto, 1, "cpu", "fp32").total == planned_peak(one, 1, "cpu", "fp32").total


def test_train_refuses_a_run_over_the_limit_before_any_work(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "lmforge", "train", "--run-dir", str(run), "--parallel.max_memory_gb=0.01"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("lmforge train: error: parallel.max_memory_gb: the planned peak per device is")
    assert "over the limit of 0.01 GB" in lines[0]
    assert not run.exists() and list(tmp_path.iterdir()) == []  # nothing written, not even the run folder


# -- measured: the build's peak of real multi-process builds --------------------------------------------

TINY = {
    "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.d_ff": 128,
    "model.tie_embeddings": False, "data.vocab_size": V, "data.seq_len": T,
    "train.compile": False, "train.precision": "fp32",
}  # fmt: skip
MEASURED = {
    2: {
        "fsdp": ({"parallel.dp_shard": 2}, Layout(dp_shard=2)),
        "tp": ({"parallel.tp": 2}, Layout(tp=2)),
        "pp": ({"parallel.pp": 2, "train.micro_batch_size": 2}, Layout(pp=2, micro_batch=2)),
        "ddp": ({"parallel.dp_replicate": 2}, Layout(dp_replicate=2)),
    },
    4: {
        "fsdp_tp": ({"parallel.dp_shard": 2, "parallel.tp": 2}, Layout(dp_shard=2, tp=2)),
        "fsdp_pp": (
            {"parallel.dp_shard": 2, "parallel.pp": 2, "train.micro_batch_size": 2},
            Layout(dp_shard=2, pp=2, micro_batch=2),
        ),
    },
}


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", sorted(MEASURED))
def test_build_peak_equals_what_each_rank_allocates(nproc: int):
    """Each rank builds its part as ``lmforge train`` does (tests/distributed/build_memory_worker.py) under
    PyTorch's MemTracker; its peak is the planned build exactly, plus the RoPE tables the plan leaves out
    and a few bytes of scalars (DDP broadcasts nothing when it wraps the model: ``init_sync=False``)."""
    cases = MEASURED[nproc]
    done = torchrun(
        nproc,
        [worker("build_memory_worker.py"), json.dumps({k: {**TINY, **o} for k, (o, _) in cases.items()})],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    measured = json.loads(done.stdout.split("BUILD ", 1)[1].splitlines()[0])
    whole = param_tensors(MODEL, V, T)
    for name, (_, layout) in cases.items():
        for rank, peak in enumerate(measured[name]):
            pp_rank = rank // (nproc // layout.pp)
            planned = build_bytes(whole, _stage(pp_rank, layout.pp), layout.kind, layout.dp_shard, layout.tp)
            extra = peak - planned.total - ROPE
            assert 0 <= extra <= 64, (name, rank, peak, planned)


def test_cli_plans_defer_grad_sync(estimate_command):
    """``--parallel.defer_grad_sync`` reaches the planned layout (and its description)."""
    code, text, err = estimate_command(
        "--model", "llama-7b", "--gpus", "8", "--json", "--train.tokens_per_step=65536",
        "--parallel.defer_grad_sync=true",
    )  # fmt: skip
    assert code == 0, err
    e = json.loads(text)["estimate"]
    assert e["layout"]["defer_grad_sync"] and "deferred grad sync" in e["layout_description"]
    assert e["accum"] == 4 and e["dp_collectives"]["reduce_scatter"] == 1
    unused = replace(Layout(dp_shard=8), defer_grad_sync=True)
    assert unused.describe().endswith("deferred grad sync")
