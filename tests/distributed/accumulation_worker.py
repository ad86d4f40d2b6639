"""Worker: FSDP2's collectives in one optimizer step of several micro-batches, per accumulation setting.

    torchrun --nproc-per-node=2 accumulation_worker.py OVERRIDES_JSON

For ZeRO-2 and ZeRO-3, each with and without ``parallel.defer_grad_sync``, builds the run as ``lmforge
train`` does (``dp_shard`` = world, the overrides' accumulation), takes one step (the optimizer states
exist from then on) and counts, in the second step, the all-gathers and reduce-scatters FSDP2 issues
(``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, which FSDP2 calls for each of its
units). Rank 0 prints one line ``ACCUM {json}``: per setting the counts, the micro-batches per step, the
number of FSDP2 units, both steps' losses and the final parameters' norms by name.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lmforge.parallel.layout import end_process_group
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.step import train_step

COUNTED = ("all_gather_single", "reduce_scatter_single")


def counting(counts: Counter) -> dict:
    """Wrap the two collectives FSDP2 uses so each call adds one to ``counts``; returns the originals."""
    originals = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name: str):
        def call(*args, **kwargs):
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in COUNTED:
        setattr(dist, name, wrap(name))
    return originals


def step(run) -> float:
    batches = [run.loader.next_batch() for _ in range(run.accum)]
    result = train_step(
        run.module, run.optimizer, batches, 1e-3, run.clipper, run.precision, reduce=run.reduce
    )
    return float(result.loss)


def main() -> None:
    torch.set_num_threads(1)
    base = json.loads(sys.argv[1])
    out = {}
    for zero in (2, 3):
        for defer in (False, True):
            over = {**base, "parallel.zero": zero, "parallel.defer_grad_sync": defer}
            run = build_run(load_config(None, over))
            losses = [step(run)]
            counts: Counter = Counter()
            originals = counting(counts)
            try:
                losses.append(step(run))
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
            params = {
                n: float((p.full_tensor() if isinstance(p, DTensor) else p).double().norm())
                for n, p in run.model.named_parameters()
            }
            units = sum(isinstance(m, FSDPModule) for m in run.module.train_fn.modules())
            out[f"zero{zero}{'_defer' if defer else ''}"] = {
                "all_gathers": counts["all_gather_single"],
                "reduce_scatters": counts["reduce_scatter_single"],
                "accum": run.accum,
                "units": units,
                "losses": losses,
                "param_norms": params,
            }
    if dist.get_rank() == 0:
        print("ACCUM " + json.dumps(out), flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
