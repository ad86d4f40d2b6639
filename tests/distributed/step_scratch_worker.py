"""The optimizer step's own scratch under ZeRO-1 and FSDP2, per rank (run by
tests/test_optimizer_step_memory.py).

``torchrun --nproc-per-node=2 step_scratch_worker.py OUT CASES``: for each layout (``zero1``: a plain
replica and :func:`build_zero_optimizer`; ``zero3``: ``fully_shard`` on each block and on the model, as
lmforge's FSDP2 units), each model shape and optimizer of ``CASES`` (JSON: ``models``, ``optims``,
``vocab``, ``seq``: the test's tables), ``probes/step_memory.py::optimizer_step_scratch``: two warm-up
steps on random gradients, then PyTorch's ``MemTracker`` around one ``optimizer.step()``, its peak minus
what was live when it began (the least of ``REPEATS``).
Rank 0 writes ``{"layout|shape|optimizer": [bytes of rank 0, bytes of rank 1]}`` as JSON to ``OUT``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer, build_zero_optimizer
from lmforge.parallel.layout import process_group_scope
from lmforge.probes.step_memory import optimizer_step_scratch

# the least of a few measurements: gloo's worker thread frees a finished all-gather's tensors only once it
# gets the GIL, so when the machine is loaded the previous matrix's gathered copy (Muon, Adafactor under
# FSDP2) can outlive its step (the test allows for it: test_optimizer_step_memory.py::lingering)
REPEATS = 2


def scratch(layout: str, model_kw: dict, optim_kw: dict, vocab: int, seq: int) -> int:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**model_kw), vocab, seq)
    cfg = OptimConfig(**optim_kw)
    if layout == "zero1":
        opt = build_zero_optimizer(model, cfg, torch.device("cpu"), compile=False)
        return min(optimizer_step_scratch(model, opt, extra=(opt.optim,)) for _ in range(REPEATS))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, cfg, torch.device("cpu"), compile=False)
    return min(optimizer_step_scratch(model, opt) for _ in range(REPEATS))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cases = json.loads(sys.argv[2])
    out = {}
    with process_group_scope():
        for layout in ("zero1", "zero3"):
            for shape, model_kw in cases["models"].items():
                for name, optim_kw in cases["optims"].items():
                    per_rank = [None] * dist.get_world_size()
                    dist.all_gather_object(
                        per_rank, scratch(layout, model_kw, optim_kw, cases["vocab"], cases["seq"])
                    )
                    out[f"{layout}|{shape}|{name}"] = per_rank
        if dist.get_rank() == 0:
            with open(sys.argv[1], "w") as f:
                json.dump(out, f)


if __name__ == "__main__":
    main()
