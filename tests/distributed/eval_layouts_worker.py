"""Worker of ``tests/test_eval_tasks.py::test_task_scores_during_training_are_the_same_in_every_layout``
(run under torchrun, 2 processes, gloo on CPU).

Arguments: a JSON object ``{"run": RUN, "step": N, "over": overrides, "layouts": [{key: value}, ...],
"out": FILE}``. For each layout: the run of ``over | layout`` built through the one build path
(``train/build.py::build_run``), the checkpoint ``RUN/checkpoints/step_N`` loaded into it as a resume
loads it (DCP reshards the one-process checkpoint into the layout), and the ``[eval]`` callback
(``TaskEvaluation``) scoring those weights through a real ``Trainer``. Each rank collects the records the
callback logs; rank 0 writes one JSON line per layout: ``{"layout", "records": rank 0's, "agreed": every
rank logged the same records}``.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.parallel.layout import end_process_group
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.evaluation import TaskEvaluation
from lmforge.train.checkpoint import load_training_state
from lmforge.train.trainer import Trainer


class Records(Callback):
    """Keeps every record logged on this rank."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_log(self, trainer: Trainer, record: dict) -> None:
        self.records.append(dict(record))


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    ckpt = Path(args["run"]) / "checkpoints" / f"step_{args['step']:08d}"
    lines = []
    for layout in args["layouts"]:
        cfg = load_config(None, args["over"] | layout)
        run = build_run(cfg)
        tasks, kept = TaskEvaluation(cfg), Records()
        trainer = Trainer(run, [tasks, kept])
        trainer.load_state_dict(load_training_state(ckpt, run.model, run.optimizer))
        assert trainer.progress.step == args["step"]
        tasks.score(trainer)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, kept.records)
        lines.append(
            {"layout": layout, "records": kept.records, "agreed": all(r == kept.records for r in everyone)}
        )
        del trainer, tasks, run
        gc.collect()
    if dist.get_rank() == 0:
        Path(args["out"]).write_text("".join(json.dumps(line) + "\n" for line in lines))
    end_process_group()


if __name__ == "__main__":
    main()
