"""The planner (``lmforge estimate``): the seed lessons' figures, DeepSpeed's published estimator, the
communication table, time and the layout search, and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from lmforge.plan import comm, hardware, models
from lmforge.plan.estimate import Layout, Workload, estimate
from lmforge.plan.flops import flops_per_token
from lmforge.plan.memory import (
    deepspeed_zero2_gpu_bytes,
    deepspeed_zero3_gpu_bytes,
    model_states,
    param_count,
    param_tensors,
    per_param_formula,
)
from lmforge.plan.search import candidate_layouts, fewest_devices, search

H100 = hardware.get("h100-80gb")
GB, GIB = 1e9, 2**30
# Tolerances: the planner is float64 arithmetic on Python numbers (no tensor, nothing CPU-dependent), so
# ``pytest.approx``'s default (1e-6 relative) and ``rel=1e-12`` only absorb the same formula's rounding in
# another order (float64's 1.1e-16 times a few dozen operations: ~1e-14 at most). The wider bounds
# compare with published figures rounded to two or three digits, and each says how far lmforge's is.


def _named(name: str) -> tuple[list, int]:
    m = models.get(name)
    tensors = param_tensors(m.model, m.vocab_size, m.seq_len)
    return tensors, sum(t.numel for t in tensors)


def _workload(name: str, **kw) -> Workload:
    m = models.get(name)
    return Workload(m.model, m.vocab_size, m.seq_len, **kw)


# -- the seed figures ---------------------------------------------------------------------------------


def test_mixed_precision_adam_is_16_bytes_per_parameter_and_7b_is_112_gb():
    one = per_param_formula("ddp", 1, 1, 8, "zero-paper")
    assert (one.params, one.grads, one.master, one.optim) == (2, 2, 4, 8)
    assert one.total == 16
    assert per_param_formula("ddp", 7e9, 1, 8, "zero-paper").total == 112 * GB


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_seed_table_per_device(n: int):
    p = 7e9
    seed = {"ddp": 16 * p, "zero1": 4 * p + 12 * p / n, "zero2": 2 * p + 14 * p / n, "zero3": 16 * p / n}
    for kind, want in seed.items():
        # rel=1e-12: the float64 closed formula against the same in another order (see the note at the top)
        assert per_param_formula(kind, p, n, 8, "zero-paper").total == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n", [2, 8])
def test_per_tensor_states_of_llama_7b_reproduce_the_seed_table(n: int):
    """The per-tensor path (what the estimator uses) gives the closed formulas on a real shape list:
    exactly where every tensor splits evenly, and within 0.5% for ZeRO-1 (whole tensors per rank)."""
    tensors, p = _named("llama-7b")
    assert all(t.shape[0] % n == 0 for t in tensors)
    want = {"ddp": 16 * p, "zero2": 2 * p + 14 * p / n, "zero3": 16 * p / n}
    for kind, value in want.items():
        got = model_states(tensors, kind, n if kind != "ddp" else 1, 1, "adamw", "zero-paper").total
        # rel=1e-12: a float64 sum over ~290 tensors against the closed formula: <= 290 x 1.1e-16 = 3e-14
        assert got == pytest.approx(value, rel=1e-12), kind
    zero1 = model_states(tensors, "zero1", n, 1, "adamw", "zero-paper").total
    # whole tensors per rank: the most loaded rank holds more than 1/n (lmforge's own arithmetic, no
    # rounding: +3.6e-7 at n = 2, +0.26% at n = 8); 0.5% is about twice the larger
    assert 4 * p + 12 * p / n <= zero1 <= 1.005 * (4 * p + 12 * p / n)
    # lmforge's own dtypes: FP32 parameters and gradients replicated under ZeRO-1, 16P/N under FSDP2
    lm = model_states(tensors, "zero3", n, 1, "adamw", "lmforge")
    assert lm.params == lm.grads == 4 * p / n and lm.master == 0
    assert lm.optim == 8 * p / n + 4 * len(tensors)  # + one FP32 step counter per tensor on every rank


def test_gpt3_175b_is_about_700_gb_of_fp32_parameters():
    _, p = _named("gpt3-175b")
    # "175B" is rounded: lmforge counts 174.60B (-0.23%); 1% is the rounding of a three-digit figure
    assert p == pytest.approx(175e9, rel=0.01)
    # 700 GB is 4 x the rounded 175B: 4p = 698.4 GB (-0.23%, as above); 1% is the published figure's rounding
    assert 4 * p == pytest.approx(700 * GB, rel=0.01)


def test_llama_65b_has_the_published_parameter_count():
    """LLaMA 65B (Touvron et al. 2023, Table 2: d 8192, 80 layers, 64 heads, d_ff 22016, vocab 32000):
    65.2B parameters; lmforge's llama block counts 65,285,660,672 (65.29B, untied head)."""
    _, p = _named("llama-65b")
    assert p == 65_285_660_672
    assert p == pytest.approx(65.2e9, rel=0.002)  # 65.29B against the paper's 65.2B: +0.13%, its rounding


def test_70b_fp32_adam_table():
    """FP32 Adam, 16 bytes per parameter (4 + 4 + 8): 1.1 TB unsharded, ~140 GB per GPU under FSDP on 8."""
    tensors, p = _named("llama-70b")
    whole = model_states(tensors, "none", 1, 1, "adamw", "lmforge")
    assert (whole.params, whole.grads) == (4 * p, 4 * p)
    # the round figures of the docstring: lmforge's totals are +0.33% and -1.46% from them
    assert whole.total == pytest.approx(1.1e12, rel=0.01)
    fsdp = model_states(tensors, "zero3", 8, 1, "adamw", "lmforge")
    # ~140 GB (two digits, the docstring): lmforge's is -1.46% from it (see above); 2% bounds that
    assert fsdp.total == pytest.approx(140 * GB, rel=0.02)


def test_deepspeed_estimator_t5_3b():
    """DeepSpeed's docs: t5-3b (2,851M parameters, largest layer its 32128 x 1024 embedding) on 8 GPUs,
    15.93 GB per GPU under ZeRO-2 and 6.10 GB under ZeRO-3 (DeepSpeed prints GiB as "GB")."""
    p, largest = 2851e6, 32128 * 1024
    assert round(deepspeed_zero2_gpu_bytes(p, 8) / GIB, 2) == 15.93
    assert round(deepspeed_zero3_gpu_bytes(p, largest, 8) / GIB, 2) == 6.10
    # the ZeRO paper's per-parameter model is lower: DeepSpeed keeps a whole-model 16-bit gradient too
    assert per_param_formula("zero2", p, 8, 8, "zero-paper").total < deepspeed_zero2_gpu_bytes(p, 8)
    assert per_param_formula("zero3", p, 8, 8, "zero-paper").total < deepspeed_zero3_gpu_bytes(p, largest, 8)


# -- communication ------------------------------------------------------------------------------------


def test_ring_collectives():
    # default approx: float64 arithmetic on Python numbers (the note at the top)
    assert comm.all_reduce(100.0, 4) == pytest.approx(150.0)  # 2 (n - 1) / n
    assert comm.reduce_scatter(100.0, 4) == pytest.approx(75.0)
    assert comm.all_reduce(100.0, 1) == 0


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2", "zero3"])
def test_data_parallel_volume_matches_the_seed_table(kind: str):
    """In parameter units (16-bit values, the ZeRO paper's convention) the volume tends to the seed's
    DDP 2P, ZeRO-1/2 2P, ZeRO-3 3P as n grows, exactly (n - 1)/n of it."""
    p, n = 1e9, 1024
    got = comm.dp_volume(kind, p, n, 2, accounting="zero-paper") / 2  # bytes -> 16-bit values
    # default approx: float64 (the note at the top): (n - 1) / n of the seed's volume up to rounding
    assert got == pytest.approx(comm.seed_volume(kind, p) * (n - 1) / n)


def test_lmforge_fsdp_volume_counts_dtypes_and_micro_batches():
    p, n = 1e6, 8
    frac = (n - 1) / n
    # ZeRO-3 under bf16: BF16 gathers in forward and backward (not the root's second), FP32 reduce-scatter
    got = comm.dp_volume("zero3", p, n, 2, accum=3, root=1e5)
    # default approx (1e-6): float64 byte counts against the same formula in another order (rounding, ~1e-16)
    assert got == pytest.approx(3 * frac * (2 * p + 2 * (p - 1e5) + 4 * p))
    assert comm.dp_volume("ddp", p, n, 2, accum=3) == pytest.approx(2 * frac * 4 * p)  # last micro-batch only


# -- the estimate ---------------------------------------------------------------------------------------


def test_estimate_rows_add_up_and_fit_uses_the_margin():
    e = estimate(_workload("llama-7b"), Layout(dp_shard=8), H100)
    rows = e.rows()
    # default approx: a float64 sum of ~10 rows against the total made of them (~10 x 1.1e-16)
    assert sum(rows.values()) == pytest.approx(e.total)
    # peak phases of both kinds: one micro-batch (the loss's backward, with every activation; or the end
    # of backward when gradients outweigh the activations, as under DDP with full checkpointing, where the
    # recomputed first block sits on every gradient but its own and the untied embedding's, which autograd
    # makes last, and then DDP's buckets hold them all), and accumulation
    phases = {e.peak_phase}
    for workload, layout in (
        (_workload("llama-7b"), Layout(dp_replicate=8, activation_checkpointing="full")),
        (replace(_workload("llama-7b"), tokens_per_step=8 * 4 * 4096), Layout(dp_shard=8)),
    ):
        other = estimate(workload, layout, H100)
        # default approx: float64 row sums, as above
        assert sum(other.rows().values()) == pytest.approx(other.total)
        phases.add(other.peak_phase)
    assert phases == {
        "backward: head and loss",
        "end of backward",
        "backward: head and loss, gradients accumulating",
    }
    assert e.fits == (e.total <= 0.8 * H100.memory_bytes)
    tight = estimate(
        _workload("llama-7b"), Layout(dp_shard=8), H100, margin=e.total / H100.memory_bytes * 0.99
    )
    assert not tight.fits


def test_flops_time_and_chinchilla():
    w = _workload("llama-7b")
    e = estimate(w, Layout(dp_shard=8), H100, mfu=0.5)
    n = param_count(w.model, w.vocab_size, w.seq_len)
    embedding = w.vocab_size * w.model.d_model  # untied: the input table costs no FLOPs
    assert e.flops_per_token == flops_per_token(n - embedding, 32, 4096, 2048)
    assert e.flops_per_step == e.flops_per_token * 8 * 2048
    # default approx: float64 products and quotients of the same figures in another order (~1e-16 each)
    assert e.compute_s == pytest.approx(e.flops_per_step / (8 * 989.4e12 * 0.5))
    assert e.chinchilla_tokens == 20 * n
    assert e.chinchilla_days == pytest.approx(20 * n / e.tokens_per_s / 86400)
    assert e.tokens_per_day == pytest.approx(e.tokens_per_s * 86400)


def test_pipeline_bubble_and_full_recompute():
    w = replace(_workload("llama-7b"), tokens_per_step=4 * 2048 * 2)
    e = estimate(w, Layout(dp_shard=2, pp=4, micro_batch=4, pp_microbatches=4), H100)
    # default approx: float64 quotient of small integers against 3 / 7 (rounding only)
    assert e.bubble == pytest.approx(3 / 7)  # (p - 1) / (m + p - 1)
    base = estimate(w, Layout(dp_shard=2, tp=4, micro_batch=4), H100)
    full = estimate(w, Layout(dp_shard=2, tp=4, micro_batch=4, activation_checkpointing="full"), H100)
    # default approx: float64 ratio 4/3 of the same FLOPs (full recompute adds one forward), rounding only
    assert full.compute_s == pytest.approx(base.compute_s * 4 / 3)
    assert full.activations < base.activations


def test_tensor_and_pipeline_parallel_divide_the_model():
    w = _workload("llama-13b")
    whole = estimate(w, Layout(dp_shard=8), H100)
    tp = estimate(w, Layout(dp_shard=2, tp=4), H100)
    pp = estimate(w, Layout(dp_shard=2, pp=4, micro_batch=4), H100)
    assert tp.device_params < whole.device_params / 3.9  # norms stay whole
    assert pp.device_params < whole.device_params / 3.5  # a stage's layers, plus embedding or head
    assert tp.comm.tp > 0 and pp.comm.pp > 0 and whole.comm.tp == whole.comm.pp == 0


def test_search_returns_fitting_layouts_fastest_first():
    w = _workload("llama-7b")
    assert not estimate(w, Layout(dp_replicate=8), H100).fits  # DDP of 7B: 16P = 100 GiB alone
    found = search(w, 8, H100, top=50)
    assert found and all(e.fits for e in found)
    speeds = [e.tokens_per_s for e in found]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.layout.world == 8 for e in found)
    assert not any(e.layout.kind == "ddp" for e in found)


def test_candidate_layouts_pass_lmforge_checks():
    """No TP for GPT-3 (vocabulary 50257 is odd); pipelines of its tied embedding are runnable."""
    layouts = candidate_layouts(_workload("gpt3-175b"), 64)
    assert layouts and all(layout.tp == 1 for layout in layouts)
    assert any(layout.pp > 1 for layout in layouts)


def test_candidate_layouts_are_runnable_by_lmforge():
    for layout in candidate_layouts(_workload("llama-70b"), 16):
        assert layout.world == 16
        if layout.kind in ("ddp", "zero1"):
            assert layout.tp == layout.pp == 1  # parallel/layout.py refuses DDP/ZeRO-1 with TP or PP
        assert 64 % layout.tp == 0 and 8 % layout.tp == 0


def test_70b_needs_more_than_8_h100_under_lmforge_accounting():
    assert search(_workload("llama-70b"), 8, H100) == []
    n, best = fewest_devices(_workload("llama-70b"), 8, H100)
    assert n in (16, 32) and best.fits and best.layout.world == n
    assert search(_workload("llama-70b"), n // 2, H100) == []


def test_a_tied_embedding_across_two_ranks_adds_its_gradients_all_reduce():
    """llama-1b ties its head: with 1f1b its first and last pipeline ranks each hold the (V, d) matrix and
    all-reduce its FP32 gradient (their shard of it) once per step, ``2 (2 - 1) / 2 * 4 V d`` bytes; zbv
    keeps both ends on one rank (one parameter, nothing sent); untied, nothing either."""
    w = replace(_workload("llama-1b"), tokens_per_step=8 * 8192 * 4)
    m = w.model
    v, d = w.vocab_size, m.d_model
    activations = comm.pp_volume(2, w.tokens_per_step // 2, d, 2)
    for layout, tied_bytes in (
        (Layout(dp_shard=2, pp=2, micro_batch=8), 4 * v * d / 2),
        (Layout(dp_shard=2, pp=2, micro_batch=8, pp_schedule="zbv"), 0),
    ):
        e = estimate(w, layout, H100)
        # default approx: float64 byte counts summed in another order (rounding only)
        assert e.comm.pp == pytest.approx(activations + tied_bytes), layout
    untied = replace(w, model=m.model_copy(update={"tie_embeddings": False}))
    # default approx: the same float64 byte counts, untied
    assert estimate(untied, Layout(dp_shard=2, pp=2, micro_batch=8), H100).comm.pp == pytest.approx(
        activations
    )


def test_the_head_goes_with_the_last_block_on_a_v_shaped_pipeline():
    """zbv: rank 0 owns the first and the last stage, so it holds the embedding and the head."""
    w = replace(_workload("llama-7b"), tokens_per_step=8 * 2048 * 2)
    e = estimate(w, Layout(dp_shard=2, pp=2, micro_batch=8, pp_schedule="zbv"), H100)
    assert e.pp_rank == 0 and e.temporaries.loss_chunk > 0


def test_cpu_device_uses_host_memory_and_the_given_peak():
    cpu = hardware.get("cpu", cpu_peak_flops=1e11)
    assert cpu.memory_bytes == hardware.host_memory_bytes() > 0
    assert cpu.peak("fp32") == 1e11
    with pytest.raises(KeyError, match="fp8"):
        hardware.get("a100-80gb").peak("fp8")


# -- command line ---------------------------------------------------------------------------------------


def test_cli_table(estimate_command):
    code, out, err = estimate_command("--model", "llama-7b", "--gpus", "8")
    assert code == 0, err
    for row in ("parameters", "gradients", "master weights", "optimizer states", "activations", "total"):
        assert row in out
    assert "fits" in out and "Chinchilla" in out and "tokens/s" in out


def test_cli_json_search_and_plot(estimate_command, tmp_path):
    png = tmp_path / "m.png"
    code, text, err = estimate_command(
        "--model", "llama-7b", "--gpus", "8", "--search", "--top", "3", "--json", "--plot", str(png)
    )
    assert code == 0, err
    out = json.loads(text)
    assert out["estimate"]["n_params"] == 6_738_415_616
    assert len(out["search"]) == 3 and all(e["fits"] for e in out["search"])
    speeds = [e["tokens_per_s"] for e in out["search"]]
    assert speeds == sorted(speeds, reverse=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_overrides_and_zero_paper_weights(estimate_command):
    code, out, err = estimate_command(
        "--model", "llama-7b", "--gpus", "4", "--weights", "zero-paper", "--json", "--optim.name=lion"
    )
    assert code == 0, err
    e = json.loads(out)["estimate"]
    assert e["accounting"] == "zero-paper" and e["layout"]["dp_shard"] == 4
    p = e["n_params"]
    # default approx: float64 byte counts read back from JSON (exact) against 4P/N, rounding only
    assert e["states"]["master"] == pytest.approx(4 * p / 4)
    assert e["states"]["optim"] == pytest.approx(4 * p / 4)  # Lion: one FP32 momentum


def test_cli_cpu_plans_for_this_host(estimate_command):
    code, out, err = estimate_command("--gpu", "cpu", "--json", "--model.n_layers=2")
    assert code == 0, err
    e = json.loads(out)["estimate"]
    assert e["device"] == "cpu" and e["memory_bytes"] == hardware.host_memory_bytes()
    assert e["tokens_per_s"] > 0 and e["overhead_runtime"] == 0.5 * 2**30


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--gpu", "v100"], "--gpu"),
        (["--model", "llama-8b"], "--model"),
        (["--gpus", "4", "--parallel.dp_shard=2"], "--gpus"),
        (["--gpu", "a100-80gb", "--train.precision=fp8"], "train.precision"),
        (["--mfu", "1.5"], "--mfu"),
        # what lmforge train refuses is refused with its line: GPT-3's vocabulary does not split in 8
        (["--model", "gpt3-175b", "--gpus", "8", "--parallel.tp=8"], "data.vocab_size"),
        (["--model", "llama-7b", "--gpus", "2", "--parallel.pp=2"], "parallel.pp_microbatches"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(estimate_command, args: list[str], flag: str):
    code, _, err = estimate_command(*args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmforge estimate: error: {flag}"), err


def test_estimate_is_pure_arithmetic_for_a_huge_model():
    """Nothing is allocated: a 175B estimate takes no memory and little time."""
    e = estimate(_workload("gpt3-175b"), Layout(dp_shard=64, tp=8, micro_batch=1), H100)
    assert math.isfinite(e.total) and e.n_params > 1.7e11


def test_every_pipeline_rank_has_its_total_and_the_peak_is_the_estimate():
    from lmforge.plan import hardware, models
    from lmforge.plan.estimate import Layout, Workload, estimate

    named = models.get("llama-7b")
    work = Workload(named.model, named.vocab_size, named.seq_len, "bf16", "adamw", "flash", 0, None, "cuda")
    layout = Layout(dp_shard=2, pp=4, micro_batch=8, pp_microbatches=8)
    e = estimate(work, layout, hardware.get("h100-80gb"))
    assert len(e.pp_rank_totals) == 4
    assert max(e.pp_rank_totals) == e.total == e.pp_rank_totals[e.pp_rank]
    # 1F1B: rank r keeps min(m, p - r) micro-batches in flight, so the first rank holds the most; the middle
    # ranks peak at their last micro-batch (every unsharded gradient of the stage, one micro-batch's
    # activations: what MemTracker shows on 2 ranks, tests/test_estimate_phases.py), the same on both
    assert e.pp_rank_totals[0] > e.pp_rank_totals[1] >= e.pp_rank_totals[2]
    assert estimate(work, Layout(dp_shard=8), hardware.get("h100-80gb")).pp_rank_totals == [
        estimate(work, Layout(dp_shard=8), hardware.get("h100-80gb")).total
    ]
