"""Per-rank model-state bytes under ZeRO-1, ZeRO-2 and ZeRO-3 (run by tests/test_estimate_measured.py).

``torchrun --nproc-per-node=2 plan_worker.py --out FILE`` builds, for each case (a model and an optimizer),
lmforge's model wrapped as lmforge wraps it (``zero1``: DDP + :func:`build_zero_optimizer`; ``zero2`` /
``zero3``: :func:`apply_fsdp` with ``parallel.zero`` 2 / 3 on a 1-D mesh of all ranks), takes one step,
and measures on every rank the bytes it holds of parameters (local shards), gradients (local shards) and
optimizer states (``state_bytes``; ZeRO-1: its rank's inner optimizer). Rank 0 writes
``{case: {layout: [{params, grads, optim} per rank]}}`` as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer, build_zero_optimizer
from lmforge.optim.state_size import state_bytes
from lmforge.parallel.data_parallel import apply_fsdp
from lmforge.parallel.layout import end_process_group

CPU = torch.device("cpu")
# vocab 301: the embedding's rows do not split evenly over 2 ranks (FSDP2's largest shard: ceil)
CASES = {
    "llama_adamw": (ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2), 301, "adamw"),
    "llama_adafactor": (ModelConfig(d_model=64, n_heads=4, n_layers=2), 301, "adafactor"),
    "llama_adamw8bit": (ModelConfig(d_model=64, n_heads=4, n_layers=2), 320, "adamw8bit"),
    "gpt2_muon": (
        ModelConfig(arch="gpt2", d_model=64, n_heads=4, n_layers=2, tie_embeddings=False),
        301,
        "muon",
    ),
    "gpt2_lion": (ModelConfig(arch="gpt2", d_model=64, n_heads=4, n_layers=2), 300, "lion"),
    # SOAP's factors and bases whole on every rank holding a piece, its moments sharded like the parameter
    "gpt2_soap": (
        ModelConfig(arch="gpt2", d_model=64, n_heads=4, n_layers=2, tie_embeddings=False),
        301,
        "soap",
    ),
}
SEQ = 16


class _Layout:
    """What :func:`apply_fsdp` reads of ``parallel/layout.py::Layout``: the mesh, the stage, offload."""

    def __init__(self, mesh, zero: int):
        self.mesh, self.zero, self.offload, self.degrees = mesh, zero, False, {"dp_replicate": 1}

    def submesh(self, *dims: str):
        return self.mesh


def _local(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(cfg: ModelConfig, vocab: int, optim: str, layout: str, mesh) -> dict:
    torch.manual_seed(0)
    model = Transformer(cfg, vocab, SEQ)
    model.init_weights()
    objective = NextTokenLoss(model, chunk=8)
    ocfg = OptimConfig(name=optim)
    if layout == "zero1":
        objective = DistributedDataParallel(objective)
        opt = build_zero_optimizer(model, ocfg, CPU, compile=False)
        inner = opt.optim
    else:
        head = model.lm_head if not cfg.tie_embeddings else None
        apply_fsdp(
            objective, list(model.blocks.values()), _Layout(mesh, int(layout[-1])), torch.float32, head
        )
        opt = inner = build_optimizer(model, ocfg, CPU, compile=False)
    x = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    loss, n = objective(x, x)
    (loss / n).backward()
    params = list(model.parameters())
    grads = sum(_local(p.grad) for p in params)
    opt.step()
    return {"params": sum(_local(p) for p in params), "grads": grads, "optim": state_bytes(inner)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict = {}
    for name, (cfg, vocab, optim) in CASES.items():
        for layout in ("zero1", "zero2", "zero3"):
            mine = measure(cfg, vocab, optim, layout, mesh)
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            results.setdefault(name, {})[layout] = every
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    end_process_group()


if __name__ == "__main__":
    main()
