"""Worker: per-rank memory of one training step, measured by PyTorch's FSDP memory tracker.

    torchrun --nproc-per-node=N memory_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does, takes one warm-up step (the optimizer states exist from then
on), then a second step under ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker`` (it follows
every tensor storage by category: sharded and unsharded parameters and gradients, optimizer states,
activations, all-gather and reduce-scatter buffers, temporaries). Rank 0 prints one line ``MEMORY {json}``
with the peak of the measured step per category and in total, in bytes, plus ``vocab_size`` (the run's
real tokenizer vocabulary, which the planner must be given) and ``accum`` (micro-batches per step).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.step import train_step


def step(run) -> None:
    batches = [run.loader.next_batch() for _ in range(run.accum)]
    train_step(run.module, run.optimizer, batches, 1e-3, run.clipper, run.precision, reduce=run.reduce)


def main() -> None:
    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(sys.argv[1])))
    step(run)
    tracker = FSDPMemTracker(run.module.train_fn, run.optimizer)
    with tracker:
        step(run)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    if run.layout.is_main:
        out = {str(k.value if hasattr(k, "value") else k): v for k, v in peak.items()}
        out |= {"vocab_size": run.data.tokenizer.vocab_size, "accum": run.accum}
        print("MEMORY " + json.dumps(out))


if __name__ == "__main__":
    main()
