"""On a CUDA GPU (skipped without one): a model whose FP32 weights exceed the GPU's memory is built by the
sharded build with NCCL, and the GPU never holds more than one of its parameters at a time.

One GPU cannot shard a model across ranks, so the model's shards live in host memory (FSDP2's CPU
offload, ``parallel.offload``, on a one-rank NCCL mesh): every parameter is drawn whole on the GPU (the
single-process random stream), its shard copied to the host, and the temporary freed. The GPU's peak
(``torch.cuda.max_memory_allocated``) is then the largest parameter plus the RoPE tables, not the model.
A forward pass of the built model gathers one block at a time onto the GPU. Training it would need its
gradients and optimizer states in host memory too (16 bytes per parameter), more than such a machine
has; the multi-rank training test with ``torchrun`` is ``tests/test_distributed.py``'s.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from lmforge.config import Config
from lmforge.data.loader import Batch
from lmforge.parallel.layout import DIMS, Layout
from lmforge.precision import PrecisionPolicy
from lmforge.train.build import training_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB, SEQ = 32000, 64


def host_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``."""
    for line in open("/proc/meminfo"):  # noqa: SIM115
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def bigger_than(gpu_bytes: int) -> dict:
    """A Llama shape (width 6144, 48 heads, MLP 16384) with enough blocks that its FP32 weights exceed
    ``gpu_bytes``."""
    d, ff = 6144, 16384
    block = 4 * d * d + 3 * d * ff + 2 * d
    embed = VOCAB * d
    layers = -(-(gpu_bytes // 4 - 2 * embed - d) // block) + 1
    return {"n_layers": layers, "d_model": d, "n_heads": 48, "d_ff": ff, "tie_embeddings": False}


def test_a_model_bigger_than_the_gpu_is_built_one_parameter_at_a_time(tmp_path):
    gpu = torch.cuda.get_device_properties(0).total_memory
    shape = bigger_than(gpu)
    cfg = Config(
        model=shape,
        data={"seq_len": SEQ, "vocab_size": VOCAB},
        train={"compile": False, "precision": "bf16", "micro_batch_size": 1},
        parallel={"offload": True},
    )
    with torch.device("meta"):
        from lmforge.model.transformer import Transformer

        whole = Transformer(cfg.model, VOCAB, SEQ)
    model_bytes = sum(p.numel() * 4 for p in whole.parameters())
    largest = max(p.numel() * 4 for p in whole.parameters())
    if host_memory_bytes() < 1.15 * model_bytes:
        pytest.skip(
            f"host memory: {host_memory_bytes() / 2**30:.0f} GiB free for {model_bytes / 2**30:.0f} GiB"
        )
    assert model_bytes > gpu
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (1, 1, 1, 1), mesh_dim_names=DIMS)
        layout = Layout(
            dict.fromkeys(DIMS, 1),
            "fsdp",
            3,
            True,
            0,
            1,
            mesh,
            mesh["dp_replicate", "dp_shard"]._flatten("dp"),
        )
        cuda = torch.device("cuda")
        torch.cuda.reset_peak_memory_stats()
        module = training_module(cfg, VOCAB, cuda, layout, torch.bfloat16)
        build_peak = torch.cuda.max_memory_allocated()
        rope = sum(b.numel() * b.element_size() for b in module.model.buffers())
        on_gpu = sum(p.numel() * p.element_size() for p in module.model.parameters() if p.is_cuda)
        assert on_gpu == 0  # every shard in host memory
        # bytes, not rounding: the build holds the largest parameter and the RoPE tables on the GPU at once;
        # 10% is room for the CUDA caching allocator's rounding of blocks (not measured here: no GPU)
        assert build_peak <= 1.1 * (largest + rope), (build_peak, largest, rope)
        torch.cuda.reset_peak_memory_stats()
        x = torch.randint(0, VOCAB, (1, SEQ + 1))
        docs = torch.zeros(1, SEQ, dtype=torch.long)
        metrics = module.evaluate([Batch(x[:, :-1], x[:, 1:], docs)], PrecisionPolicy("bf16", cuda))
        forward_peak = torch.cuda.max_memory_allocated()
        assert torch.isfinite(torch.tensor(metrics["val_loss"]))
        assert forward_peak < gpu / 4  # one gathered block at a time (and the next, prefetched)
        print(
            f"\nmodel {model_bytes / 2**30:.1f} GiB FP32 ({shape['n_layers']} blocks), GPU {gpu / 2**30:.1f} GiB: "
            f"build peak {build_peak / 2**30:.2f} GiB (largest parameter {largest / 2**30:.2f} GiB), "
            f"forward peak {forward_peak / 2**30:.2f} GiB, val_loss {metrics['val_loss']:.3f}"
        )
    finally:
        dist.destroy_process_group()
