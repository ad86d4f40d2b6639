"""Worker: gradient noise, gradient centralization and cautious weight decay on sharded gradients.

    torchrun --nproc-per-node=2 techniques_worker.py

Three checks, each against one process doing the same on whole tensors (every rank computes that
reference itself), all float64:

* ``fsdp2``: a small MLP under ``fully_shard`` (2 ranks, dim-0 shards, 5 rows: uneven), both ranks given
  the same batch (so FSDP2's averaged gradient is the one-process gradient), three steps of: backward,
  noise + centralization (``GradTransforms``), AdamW with cautious decay (``build_optimizer``);
  the largest difference of the gathered parameters to the one-process model's.
* ``placements``: a gradient as a DTensor sharded on dim 0, on dim 1 (tensor parallelism's row-wise
  layers: a row's mean needs both ranks' parts) and replicated: noise and centralization, gathered, against
  the whole tensor's.
* ``ddp``: plain (replicated) gradients: both ranks draw the same noise (their replicas stay equal).

Prints ``RESULTS {json}`` on rank 0: the largest absolute differences.
"""

from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lmforge.config import OptimConfig
from lmforge.optim.build import build_optimizer
from lmforge.optim.grad_transforms import GradTransforms

CPU = torch.device("cpu")
CFG = OptimConfig(lr=0.05, weight_decay=0.3, cautious_weight_decay=True, fused=False)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def fsdp2(mesh) -> float:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model = copy.deepcopy(ref)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pairs = []
    for m in (model, ref):
        tr = GradTransforms.for_model(m, True, 0.01, 0.55, 3)
        pairs.append((m, tr, build_optimizer(m, CFG, CPU)))
    for _ in range(3):
        for m, tr, opt in pairs:
            ((m(x) - y) ** 2).mean().backward()
            tr.apply([g["params"] for g in opt.param_groups])
            opt.step()
            opt.zero_grad()
    return max(
        (whole(a) - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters(), strict=True)
    )


def placements(mesh) -> float:
    torch.manual_seed(1)
    g = torch.randn(5, 6, dtype=torch.float64)
    worst = 0.0
    for placement in (Shard(0), Shard(1), Replicate()):
        p = nn.Parameter(distribute_tensor(torch.zeros(5, 6, dtype=torch.float64), mesh, [placement]))
        p.grad = distribute_tensor(g.clone(), mesh, [placement])
        q = nn.Parameter(torch.zeros(5, 6, dtype=torch.float64))
        q.grad = g.clone()
        for param in (p, q):
            GradTransforms({id(param): "w"}, frozenset({id(param)}), eta=0.01, seed=5).apply([[param]])
        worst = max(worst, (whole(p.grad) - q.grad).abs().max().item())
    return worst


def ddp() -> float:
    p = nn.Parameter(torch.zeros(100, dtype=torch.float64))
    p.grad = torch.zeros_like(p)
    GradTransforms({id(p): "v"}, eta=0.01, seed=9).apply([[p]])
    both = [torch.zeros_like(p.grad) for _ in range(2)]
    dist.all_gather(both, p.grad)
    assert both[0].abs().sum() > 0
    return (both[0] - both[1]).abs().max().item()


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {"fsdp2": fsdp2(mesh), "placements": placements(mesh), "ddp": ddp()}
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
