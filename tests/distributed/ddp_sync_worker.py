"""Worker: DDP all-reduces gradients once per optimizer step, in its last micro-batch.

    torchrun --nproc-per-node=2 ddp_sync_worker.py OVERRIDES_JSON

Counts the gradient buckets DDP reduces (a communication hook around its default all-reduce) in one
backward of a single micro-batch, then in one ``train_step`` of ``accum`` micro-batches; prints both.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.step import train_step


def main() -> None:
    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(sys.argv[1])))
    reduced: list[int] = []

    def count(group, bucket):
        reduced.append(1)
        return default_hooks.allreduce_hook(group, bucket)

    ddp = run.module.train_fn  # the DDP-wrapped model and loss
    ddp.register_comm_hook(run.layout.group("dp"), count)
    batch = run.loader.next_batch()
    loss, _ = ddp(batch.inputs, batch.targets, batch.doc_ids)
    loss.backward()
    per_backward = len(reduced)
    run.optimizer.zero_grad(set_to_none=True)
    reduced.clear()
    batches = [run.loader.next_batch() for _ in range(run.accum)]
    train_step(run.module, run.optimizer, batches, 1e-3, run.clipper, run.precision, reduce=run.reduce)
    if run.layout.is_main:
        print(
            "COUNTS "
            + json.dumps({"accum": run.accum, "per_backward": per_backward, "per_step": len(reduced)})
        )


if __name__ == "__main__":
    main()
