"""Worker: a run whose gradients turn NaN on ONE rank only must be skipped, and rolled back, on all ranks.

    torchrun --nproc-per-node=N guard_worker.py RUN_DIR OVERRIDES_JSON

Attempt 3 gets a NaN gradient on the last rank only, attempts 6, 7 and 8 on rank 0 only (three bad steps
in a row: a rollback to the step-5 checkpoint). With one process the same attempts get the NaN.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lmforge.recipe import load_config
from lmforge.train.callbacks import Callback
from lmforge.train.launch import train


class NaNOnOneRank(Callback):
    def __init__(self, plan: dict[int, int]):
        self.plan = plan  # attempt -> rank whose gradient turns NaN

    def after_backward(self, trainer) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        target = self.plan.get(trainer.attempt)
        if target is None or (target % world) != rank:
            return
        grad = trainer.run.model.blocks[0].mlp.up_proj.weight.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.view(-1)[0] = float("nan")


def main() -> None:
    run_dir, over = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    summary = train(
        load_config(None, over),
        run_dir,
        progress_bar=False,
        callbacks=[NaNOnOneRank({3: -1, 6: 0, 7: 0, 8: 0})],
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("SUMMARY " + json.dumps({k: summary[k] for k in ("skipped_steps", "rollbacks", "step")}))


if __name__ == "__main__":
    main()
