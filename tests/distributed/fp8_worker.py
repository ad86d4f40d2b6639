"""Worker of tests/test_precision_distributed.py: what FSDP2 all-gathers under ``train.precision = "fp8"``.

    torchrun --nproc-per-node=N fp8_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does (``build_run``: meta device, FP8 conversion, FSDP2, each rank's
shards materialised; the float8 scale precompute registered on the optimizer) and trains
``train.steps`` optimizer steps at the constant rate ``optim.lr`` under a ``TorchDispatchMode`` that
records every c10d collective the process issues: FSDP2 calls ``c10d._allgather_base_`` with the bytes it
gathers (its copy-in buffer), so the mode sees the dtype and the element count of what goes over the
wire. torchao's per-weight float8 cast without a precomputed scale all-reduces each weight's amax
(``_c10d_functional.all_reduce`` of one FP32 value per float8 layer and all-gather); the one-element FP32
all-reduces are counted (the step's own loss reduction is one of them).

Then, with FSDP2: every float8 layer's precomputed scale against its weight's
``float8_e4m3fn max / amax(|W|)`` (the whole weight, gathered here with ``full_tensor()``), once after the
last step and once after loading a state whose float8 weights are doubled (``load_model_state``, as a
resume does: the scale must follow the new weights).

Rank 0 prints one line ``FP8 {json}``: the losses, per step the all-gathers (dtype, elements of this
rank's input) and the number of one-element FP32 all-reduces, the number of float8 layers and the
largest relative scale errors.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.parallel.layout import end_process_group
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.checkpoint import load_model_state, model_state
from lmforge.train.step import train_step

ALL_GATHER = torch.ops.c10d._allgather_base_.default
ALL_REDUCE = torch.ops.c10d.allreduce_.default  # (tensors, group, op, ...)
FUNCTIONAL_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default  # (tensor, op, group name)


class Collectives(TorchDispatchMode):
    """Records the all-gathers (dtype and element count of this rank's input) and counts the one-element
    FP32 all-reduces issued under it."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: list[tuple[str, int]] = []
        self.scalar_reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ALL_GATHER:  # (output, input, group, ...)
            self.gathers.append((str(args[1].dtype), args[1].numel()))
        elif func in (ALL_REDUCE, FUNCTIONAL_ALL_REDUCE):
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.scalar_reduces += all(t.numel() == 1 and t.dtype == torch.float32 for t in tensors)
        return func(*args, **(kwargs or {}))


def scale_error(layers: list) -> float:
    """Largest relative difference between a layer's precomputed float8 scale and the one of its weight."""
    worst = 0.0
    for layer in layers:
        whole = layer.weight.full_tensor()
        want = (torch.finfo(torch.float8_e4m3fn).max / whole.abs().max().double()).float()
        got = layer.weight._local_tensor._precomputed_scale
        if got is None:  # none precomputed: each all-gather reduces the weight's amax itself
            return float("inf")
        worst = max(worst, float((got - want).abs() / want))
    return worst


def main() -> None:
    torch.set_num_threads(1)
    cfg = load_config(None, json.loads(sys.argv[1]))
    run = build_run(cfg)
    from lmforge.precision import float8_gathered

    layers = float8_gathered(run.model)
    losses, steps = [], []
    for _ in range(cfg.train.steps):
        batches = [run.loader.next_batch() for _ in range(run.accum)]
        seen = Collectives()
        with seen:
            result = train_step(
                run.module,
                run.optimizer,
                batches,
                cfg.optim.lr,
                run.clipper,
                run.precision,
                reduce=run.reduce,
            )
        losses.append(float(result.loss))
        steps.append({"gathers": sorted(set(seen.gathers)), "scalar_reduces": seen.scalar_reduces})
    out = {"losses": losses, "steps": steps, "float8_gathered": len(layers)}
    if layers:
        out["scale_error"] = scale_error(layers)
        state = model_state(run.model)
        doubled = {id(layer.weight) for layer in layers}
        params = dict(run.model.named_parameters())
        state = {k: v * 2 if id(params.get(k)) in doubled else v for k, v in state.items()}
        load_model_state(run.model, state)
        out["scale_error_after_load"] = scale_error(layers)
    if dist.is_initialized():
        if dist.get_rank() == 0:
            print("FP8 " + json.dumps(out), flush=True)
        end_process_group()
    else:
        print("FP8 " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
