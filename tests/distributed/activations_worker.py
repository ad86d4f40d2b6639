"""Worker: the bytes one forward of lmforge's training objective keeps for backward, on each rank of a
data-parallel layout (run by tests/test_estimate_fsdp_activations.py).

    torchrun --nproc-per-node=2 activations_worker.py CASES_JSON

``CASES_JSON`` maps a case name to config overrides (a tiny model, ``parallel.*``, ``train.precision``).
For each case the training module is built as ``lmforge train`` builds it (``train/build.py``:
``training_module`` with the precision's compute dtype, so ZeRO-2/3 apply FSDP2's ``MixedPrecisionPolicy``
and DDP / ZeRO-1 wrap ``DistributedDataParallel``), takes two forwards and backwards (FSDP2's lazy
initialisation; DDP rebuilds its gradient buckets in the second forward), then one forward under the
run's autocast measured by ``probes/activation_memory.py::saved_activation_bytes``. Rank 0 prints one line
``ACTS {case: [bytes per rank]}``.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from lmforge.parallel.layout import end_process_group, init_layout
from lmforge.precision import PrecisionPolicy
from lmforge.probes.activation_memory import saved_activation_bytes
from lmforge.recipe import load_config
from lmforge.train.build import training_module

CPU = torch.device("cpu")


def saved_bytes(overrides: dict) -> int:
    cfg = load_config(None, overrides)
    layout = init_layout(cfg, "cpu")
    policy = PrecisionPolicy(cfg.train.precision, CPU)
    objective = training_module(cfg, cfg.data.vocab_size, CPU, layout, policy.compute_dtype).train_fn
    B, T = cfg.train.micro_batch_size, cfg.data.seq_len
    x = torch.randint(
        0, cfg.data.vocab_size, (B, T), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[:, T // 2 :] = 1  # two documents per sequence: the document mask is in play

    def forward():
        with policy.autocast():
            return objective(x, x, docs)

    for _ in range(2):  # DDP rebuilds its gradient buckets in the second forward: not an activation
        forward()[0].backward()
    return saved_activation_bytes(forward)


def main() -> None:
    torch.set_num_threads(1)
    measured = {}
    for name, overrides in json.loads(sys.argv[1]).items():
        mine = saved_bytes(overrides)  # the first case starts the process group
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        measured[name] = every
    if dist.get_rank() == 0:
        print("ACTS " + json.dumps(measured), flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
