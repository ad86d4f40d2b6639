"""Worker: every rank's peak of one training step, where modules run more than once a step (pipeline
micro-batches, accumulation).

    torchrun --nproc-per-node=N phases_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does and measures one step after a warm-up step with
``probes/step_memory.py::measure_step`` (PyTorch's ``MemTracker``, which the probe lets follow a module's
repeated forwards). Rank 0 prints one ``PEAK {json}`` line per rank (gathered, so two ranks' lines never
interleave): its rank, the peak's total bytes and the run's tokenizer vocabulary.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from lmforge.parallel.layout import process_group_scope
from lmforge.probes.step_memory import measure_step
from lmforge.recipe import load_config
from lmforge.train.build import build_run


def main() -> None:
    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(sys.argv[1])))
    with process_group_scope():
        total = measure_step(run).total
        mine = {"rank": dist.get_rank(), "total": total, "vocab_size": run.data.tokenizer.vocab_size}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() == 0:
            for r in ranks:
                print("PEAK " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
