"""The planner's step phases (``plan/estimate.py::step_phases``) against PyTorch's memory trackers on real
steps of runs built by ``train/build.py::build_run``.

``probes/step_memory.py::measure_step`` takes a warm-up step, then follows one step under
``MemTracker`` (one process) or ``FSDPMemTracker`` (FSDP2, two gloo processes through
``tests/distributed/memory_worker.py``) and keeps the snapshot of its peak. The planner gets the same
recipe, FP32 or BF16 resolved as the run resolves it, the attention kernel a CPU run gets and the run's
real tokenizer vocabulary; what is compared is its tracked part, ``total - overhead``.

Each case is one the former phase model (every temporary at the start of backward, nothing at its end
beyond the gradients) got wrong: a tied embedding's three ``V x d`` gradients at the end of backward
(-15.6% before), the blocks' backward with its working set (-3.6%), BF16's loss backward, and under
FSDP2 ZeRO-3 the gathered copies, reduce-scatter buffers and loss buffers of the moment of the peak
(+5.6%, with a reduce buffer and the loss's buffers that the tracker shows freed or not yet there).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import Estimate, estimate, layout_from_config, workload_from_config
from lmforge.plan.hardware import cpu
from lmforge.recipe import load_config
from tests.conftest import tiny_overrides
from tests.torchrun import torchrun, worker

# Requirements on the planner, not rounding: tensor bytes counted by PyTorch's trackers, the same on every
# CPU. One process: 2%, measured -0.06% (tied embedding), +1.10% (blocks' backward), -0.22% (BF16 loss)
# on a 2-core AMD EPYC with AVX-512-BF16 (``-s`` prints each). Elsewhere the planner's stated 5%
# (docs/memory-accuracy.md); the one-process full-checkpointing case measured +4.93% against it.
ONE_PROCESS_TOLERANCE = 0.02
DISTRIBUTED_TOLERANCE = 0.05


def _planned(over: dict, vocab_size: int) -> Estimate:
    cfg = load_config(None, over)
    number_format = "bf16" if cfg.train.precision == "bf16" else "fp32"
    workload = workload_from_config(
        cfg, number_format, attention_kind("cpu", cfg.train.attention, cfg.model.doc_mask), "cpu"
    )
    return estimate(replace(workload, vocab_size=vocab_size), layout_from_config(cfg), cpu(1.0))


def _error(est: Estimate, measured: int) -> float:
    return (est.total - est.overhead) / measured - 1


# one process: (overrides, the phase of the peak, a temporary alive in it)
ONE_PROCESS = {
    # 16 tokens, one block: the end of backward, where the head's and the embedding's gradients and
    # their sum coexist, outweighs every earlier phase
    "tied-embedding": (
        {"data.seq_len": 16, "train.micro_batch_size": 1, "model.n_layers": 1},
        "end of backward",
        "tied_grads",
    ),
    # 256 tokens of a 64-wide Llama: the last block's MLP backward
    "blocks-backward": (
        {"data.seq_len": 64, "model.d_model": 64, "train.loss_chunk": 32},
        "backward: last block",
        "block_backward",
    ),
    # BF16 autocast: the fused loss's backward, 8 bytes per logit of a chunk as in FP32
    "bf16-loss": (
        {"data.seq_len": 64, "model.d_model": 64, "train.loss_chunk": 32, "train.precision": "bf16"},
        "backward: head and loss",
        "loss_backward",
    ),
    # full checkpointing, untied: the first block's backward recomputing, before the embedding's gradient
    # exists (autograd makes it last; +8.2% when the plan counted it there)
    "untied-full-checkpointing": (
        {
            "data.seq_len": 64,
            "model.d_model": 64,
            "model.tie_embeddings": False,
            "model.n_kv_heads": 2,
            "train.activation_checkpointing": "full",
            "optim.name": "sgd",
        },
        "backward: first block, a checkpointed block recomputing",
        "block_backward",
    ),
}


@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_one_process_peak_phase_against_the_tracker(case, corpus_dir, tmp_path_factory):
    from lmforge.probes.step_memory import measure_step
    from lmforge.train.build import build_run

    extra, phase, alive = ONE_PROCESS[case]
    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("cache")) | extra
    run = build_run(load_config(None, over))
    measured = measure_step(run)
    est = _planned(over, run.data.tokenizer.vocab_size)
    error = _error(est, measured.total)
    report = (
        f"{case}: {est.peak_phase}, measured {measured.total:,} {measured.categories}, planned {est.rows()}"
    )
    # the recomputing block frees part of its activations inside its own backward before the peak, which
    # the plan does not follow: +4.9% measured here (2-core AMD EPYC), the matrix's 5% bound
    tolerance = DISTRIBUTED_TOLERANCE if case == "untied-full-checkpointing" else ONE_PROCESS_TOLERANCE
    print(f"{case}: planned against measured {error:+.2%}")
    assert abs(error) <= tolerance, f"error {error:+.2%}; {report}"
    assert est.peak_phase == phase and alive in est.temporaries_alive, f"{report} {est.phase_totals}"


@pytest.mark.distributed
def test_zero3_peak_is_the_last_blocks_backward_with_what_the_tracker_shows_alive(
    corpus_dir, tmp_path_factory
):
    """ZeRO-3, FP32, 4 blocks 128 wide on 2 processes: at the peak (the last block's MLP backward) the
    tracker holds the root and two blocks gathered (the one computing and the next one's all-gather
    buffer), no reduce-scatter buffer, none of the loss's buffers; the peak within 5%."""
    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("cache")) | {
        "data.seq_len": 64,
        "model.n_layers": 4,
        "model.d_model": 128,
        "parallel.dp_shard": 2,
        "parallel.zero": 3,
    }
    proc = torchrun(2, [worker("memory_worker.py"), json.dumps(over)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    measured = json.loads(line.removeprefix("MEMORY "))
    est = _planned(over, measured["vocab_size"])
    error = _error(est, measured["Total"])
    report = f"{est.peak_phase}; measured {measured}"
    assert abs(error) <= DISTRIBUTED_TOLERANCE, f"error {error:+.2%}; {report}"
    report += f"; planned {est.temporaries_alive} {est.phase_totals}"
    assert est.peak_phase == "backward: last block", report
    alive = est.temporaries_alive
    assert alive["fsdp_gathered"] == measured.get("Unsharded Param", 0) + measured.get("All Gather", 0), (
        report
    )
    assert alive.get("fsdp_grad_reduce", 0) == measured.get("Reduce Scatter", 0) == 0, report
    assert "loss_forward" not in alive and "loss_backward" not in alive, report


@pytest.mark.distributed
def test_1f1b_pipeline_ranks_against_the_tracker(corpus_dir, tmp_path_factory):
    """1F1B over 2 ranks, 2 pipeline micro-batches, FP32, 4 blocks 128 wide: rank 0 meets its first
    backward with both micro-batches' activations and no gradient yet (the former model put the whole
    stage's gradients beside them: +9.2%), rank 1 its second with the first's gradients and one
    micro-batch's activations. Each rank's planned total (``pp_rank_totals`` less the overhead) within 5%
    of its tracker's peak."""
    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("cache")) | {
        "data.seq_len": 64,
        "model.n_layers": 4,
        "model.d_model": 128,
        "parallel.pp": 2,
        "parallel.pp_schedule": "1f1b",
        "parallel.pp_microbatches": 2,
    }
    proc = torchrun(2, [worker("phases_worker.py"), json.dumps(over)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    peaks = [
        json.loads(ln.removeprefix("PEAK ")) for ln in proc.stdout.splitlines() if ln.startswith("PEAK ")
    ]
    measured = {p["rank"]: p["total"] for p in peaks}
    est = _planned(over, peaks[0]["vocab_size"])
    for rank, total in enumerate(est.pp_rank_totals):
        planned = (total - est.overhead_runtime) / (1 + est.overhead_fraction)
        error = planned / measured[rank] - 1
        assert abs(error) <= DISTRIBUTED_TOLERANCE, (
            f"rank {rank}: {planned:,.0f} vs {measured[rank]:,} ({error:+.2%})"
        )
