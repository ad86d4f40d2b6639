"""The estimate's activations row against the bytes lmforge's training objective keeps for backward on 2 gloo
processes, in every data-parallel layout and 16-bit precision.

``tests/distributed/activations_worker.py`` builds each case's training module as ``lmforge train`` does
(ZeRO-2/3: FSDP2 with its ``MixedPrecisionPolicy``; DDP and ZeRO-1: ``DistributedDataParallel`` under
autocast) and measures one forward with ``probes/activation_memory.py::saved_activation_bytes`` on each rank.
The planner (``plan/estimate.py``) is given the same recipe; its activations less the transient on top of
the saved bytes (one block's recomputation or autocast's weight cache) must equal the measurement, to the
byte (FP8: plus one 4-byte FP32 scale per float8 linear layer, which the planner leaves out).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmforge.plan import hardware
from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
from lmforge.recipe import load_config
from tests.torchrun import torchrun, worker

BASE = {
    "model.n_layers": 3,
    "model.d_model": 64,
    "model.n_heads": 4,
    "data.vocab_size": 300,
    "data.seq_len": 32,
    "train.micro_batch_size": 2,
    "train.loss_chunk": 16,
    "train.compile": False,
    "train.precision": "bf16",
    "parallel.dp_shard": 2,
}
ARCH = {
    "llama": {"model.arch": "llama", "model.n_kv_heads": 2, "model.tie_embeddings": False},  # GQA, untied
    "gpt2": {"model.arch": "gpt2", "model.tie_embeddings": True},
}
CASES = {
    f"zero3-bf16-{arch}-{policy}": {**ARCH[arch], "train.activation_checkpointing": policy}
    for arch in ARCH
    for policy in ("none", "selective", "every:2", "full")
} | {
    "zero2-bf16-llama-every:2": {**ARCH["llama"], "parallel.zero": 2, "train.activation_checkpointing": "every:2"},
    "zero3-fp16-gpt2-selective": {**ARCH["gpt2"], "train.precision": "fp16",
                                  "train.activation_checkpointing": "selective"},
    "zero3-fp8-llama-none": {**ARCH["llama"], "train.precision": "fp8"},
    "ddp-bf16-llama-every:2": {**ARCH["llama"], "parallel.dp_shard": 1, "parallel.dp_replicate": 2,
                               "train.activation_checkpointing": "every:2"},
    "zero1-bf16-gpt2-full": {**ARCH["gpt2"], "parallel.zero": 1, "train.activation_checkpointing": "full"},
}  # fmt: skip
FP8_LINEARS_PER_BLOCK = 7  # q, k, v, o, gate, up, down: each keeps one FP32 scale


@pytest.fixture(scope="module")
def measured() -> dict:
    cases = {name: BASE | over for name, over in CASES.items()}
    proc = torchrun(2, [worker("activations_worker.py"), json.dumps(cases)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ACTS ")]
    return json.loads(line.removeprefix("ACTS "))


def planned_saved(over: dict) -> float:
    cfg = load_config(None, over)
    precision = cfg.train.precision
    workload = workload_from_config(cfg, precision, attention_kind("cpu", cfg.train.attention), "cpu")
    hw = hardware.cpu(1e11)
    hw = replace(hw, peak_flops={**hw.peak_flops, "fp8": 1e11})  # FP8 is emulated on the CPU
    e = estimate(workload, layout_from_config(cfg), hw)
    return e.activations - max(e.activation_parts["recompute"], e.activation_parts["forward_casts"])


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_estimate_activations_equal_what_each_rank_saves(case: str, measured: dict):
    over = BASE | CASES[case]
    planned = planned_saved(over)
    extra = 4 * FP8_LINEARS_PER_BLOCK * over["model.n_layers"] if over["train.precision"] == "fp8" else 0
    for rank, got in enumerate(measured[case]):
        assert planned + extra == got, f"{case} rank {rank}: planned {planned:,.0f} B, measured {got:,} B"
