"""Worker: every rank's peak memory while lmforge builds its part of the model, for several layouts of 2
ranks (run by tests/test_estimate_build.py).

    torchrun --nproc-per-node=2 build_memory_worker.py CASES_JSON

``CASES_JSON`` maps a case name to config overrides (a tiny model, ``parallel.*``). For each case the
training module is built as ``lmforge train`` builds it (``train/build.py``: ``training_module``, or
``build_pipeline`` under ``parallel.pp``: meta device, transformations, then the rank's shards materialised
and initialised) inside PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``: every tensor
storage the process allocates), whose peak is the measurement. Rank 0 prints one line
``BUILD {case: [peak bytes per rank]}``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from lmforge.parallel.layout import end_process_group, init_layout
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config
from lmforge.train.build import build_pipeline, training_module

CPU = torch.device("cpu")


def build_peak(overrides: dict) -> int:
    cfg = load_config(None, overrides)
    layout = init_layout(cfg, "cpu")
    tracker = MemTracker()
    with tracker:
        if cfg.parallel.pp > 1:
            build_pipeline(cfg, cfg.data.vocab_size, CPU, layout, PrecisionPolicy("fp32", CPU))
        else:
            training_module(cfg, cfg.data.vocab_size, CPU, layout)
    peaks = tracker.get_tracker_snapshot("peak")
    return sum(stats["Total"] for device, stats in peaks.items() if device.type != "meta")


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(sys.argv[1])
    measured = {}
    for name, overrides in cases.items():
        mine = build_peak(overrides)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        measured[name] = every
    if dist.get_rank() == 0:
        print("BUILD " + json.dumps(measured), flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
