"""The planner's per-rank memory under FSDP2 against PyTorch's FSDP memory tracker, on real runs.

Each case launches ``lmforge``'s own training run on two processes (gloo on CPU, FP32) through
``tests/distributed/memory_worker.py``: it builds the run as ``lmforge train`` does, takes a warm-up step,
then measures a second step with ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` and
reports the peak (its categories at that moment and their total). The planner (``plan/estimate.py``) is
given the same recipe: ``workload_from_config`` / ``layout_from_config`` with the resolved precision
``fp32``, the attention kernel a CPU run gets and the run's real tokenizer vocabulary.

The tracker sees tensors only, not the allocator's or the runtime's own memory, so what is compared is the
planner's tracked part, ``total - overhead`` (the stated framework overhead: runtime + fragmentation),
with the tracker's peak ``Total``; they must agree within 10%.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
from lmforge.plan.hardware import cpu
from lmforge.recipe import load_config
from tests.conftest import tiny_overrides
from tests.torchrun import torchrun, worker

# the docstring's 10%: a requirement on the planner, not rounding (tensor bytes from FSDPMemTracker, the
# same on every CPU); each case prints its error (not re-measured with the tolerance work)
TOLERANCE = 0.10
BASE = {
    "data.vocab_size": 512,
    "data.seq_len": 64,
    "model.n_layers": 4,
    "model.d_model": 128,
    "model.n_heads": 4,
    "train.micro_batch_size": 4,
    "train.precision": "fp32",
    "train.compile": False,
    "parallel.dp_shard": 2,
}
CASES = {
    "zero3": {"parallel.zero": 3},
    "zero2": {"parallel.zero": 2},
    "zero3-full-checkpointing": {"parallel.zero": 3, "train.activation_checkpointing": "full"},
}


def _measure(over: dict) -> dict:
    proc = torchrun(2, [worker("memory_worker.py"), json.dumps(over)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("MEMORY ")]
    return json.loads(line.removeprefix("MEMORY "))


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_per_rank_memory_within_10_percent_of_the_tracker(case, corpus_dir, tmp_path_factory):
    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("cache"))
    over.update(BASE | CASES[case])
    measured = _measure(over)
    cfg = load_config(None, over)
    workload = workload_from_config(
        cfg, "fp32", attention_kind("cpu", cfg.train.attention, cfg.model.doc_mask), "cpu"
    )
    # the tokenizer's vocabulary, not the requested one (the run computes the fused loss, the default)
    workload = replace(workload, vocab_size=measured["vocab_size"])
    est = estimate(workload, layout_from_config(cfg), cpu(1.0))
    planned = est.total - est.overhead
    error = planned / measured["Total"] - 1
    t = est.temporaries
    report = (
        f"{case}: planned {planned:,.0f} B (total {est.total:,.0f} - overhead {est.overhead:,.0f}), "
        f"measured {measured['Total']:,} B, error {error:+.1%}\n"
        f"  planned: params {est.states.params:,.0f}, grads at the peak {est.gradients_at_peak:,.0f} "
        f"(of {est.states.grads:,.0f}), optimizer {est.states.optim:,.0f}, activations {est.activations:,.0f} "
        f"{est.activation_parts}, FSDP gathered {t.fsdp_gathered:,.0f}, grad reduce {t.fsdp_grad_reduce:,.0f}, "
        f"loss chunk {t.loss_chunk:,.0f}, optimizer step {t.optimizer_step:,.0f}\n"
        f"  measured: {measured}"
    )
    print(report)
    assert abs(error) <= TOLERANCE, report
