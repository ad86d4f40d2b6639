"""Worker: every rank's peak of one training step under PyTorch's ``MemTracker``, where modules run more
than once a step (pipeline micro-batches, accumulation).

    torchrun --nproc-per-node=N phases_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does, takes one warm-up step, then follows a second one with
``torch.distributed._tools.mem_tracker.MemTracker`` over the rank's model and optimizer. The tracker
refuses a module's second forward in one step (its per-module statistics are per call); its device-wide
peak does not depend on them, so they are cleared when that happens and the peak goes on. Every rank
prints ``PEAK {json}``: its rank, the peak's total bytes and the run's tokenizer vocabulary.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from lmforge.probes.step_memory import take_step
from lmforge.recipe import load_config
from lmforge.train.build import build_run


def main() -> None:
    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(sys.argv[1])))
    take_step(run)
    tracker = MemTracker()
    tracker.track_external(run.model, run.optimizer)
    first_call = tracker._pre_fw_hook

    def pre_forward(module, inputs):
        try:
            return first_call(module, inputs)
        except NotImplementedError:  # a second call of a module this step: per-module stats only
            tracker.reset_mod_stats()
            return first_call(module, inputs)

    tracker._pre_fw_hook = pre_forward
    with tracker:
        take_step(run)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    total = int(next(v for k, v in peak.items() if str(getattr(k, "value", k)) == "Total"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    print("PEAK " + json.dumps({"rank": rank, "total": total, "vocab_size": run.data.tokenizer.vocab_size}))


if __name__ == "__main__":
    main()
