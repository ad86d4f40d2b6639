"""Worker: per-rank memory of one training step, measured by PyTorch's FSDP memory tracker.

    torchrun --nproc-per-node=N memory_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does and measures it with ``probes/step_memory.py::measure_step``: one warm-up step (the optimizer states exist from then
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

from lmforge.parallel.layout import process_group_scope
from lmforge.probes.step_memory import measure_step
from lmforge.recipe import load_config
from lmforge.train.build import build_run


def main() -> None:
    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(sys.argv[1])))
    with process_group_scope():
        peak = measure_step(run)  # FSDPMemTracker for FSDP2 units (probes/step_memory.py)
        if run.layout.is_main:
            out = {"Total": peak.total, **peak.categories}
            out |= {"vocab_size": run.data.tokenizer.vocab_size, "accum": run.accum}
            print("MEMORY " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
