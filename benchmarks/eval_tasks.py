"""The shipped tasks (``lmforge eval --tasks``) on a run's checkpoints and on freshly drawn weights of the
same shape: how far training moves each score above its random-init value.

    python benchmarks/eval_tasks.py RUN [--tasks stdlib_docstring,stdlib_next_line,stdlib_assign]
        [--seeds 0,1,2] [--threads 2] [--limit N]

Each checkpoint of RUN is scored as ``lmforge eval RUN --tasks ... --step N`` scores it (nothing is
written to RUN); the random-init rows use the run's config and tokenizer, the weights drawn as training
draws them from ``train.seed = SEED``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lmforge.evaluate.run_loading import load_run
from lmforge.evaluate.task_scoring import resolve_tasks
from lmforge.evaluate.tasks import score_tasks
from lmforge.precision import PrecisionPolicy
from lmforge.train.build import build_model
from lmforge.train.checkpoint import list_checkpoints


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--tasks", default="stdlib_docstring,stdlib_next_line,stdlib_assign")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="the first N questions of each task (0: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    tasks = resolve_tasks(args.tasks)
    for task in tasks:
        task.items = task.items[: args.limit or None]
    rows = []
    steps = [int(p.name.removeprefix("step_")) for p in list_checkpoints(Path(args.run))]
    for step in steps:
        start = time.perf_counter()
        cfg, tok, model, _ = load_run(args.run, cpu, step)
        precision = PrecisionPolicy.resolve(cfg.train.precision, cpu)
        scores = score_tasks(tasks, model, tok, cfg.data.seq_len, 16, precision)
        rows.append({"weights": f"step {step}", "seconds": time.perf_counter() - start, "tasks": scores})
        print(json.dumps({"weights": rows[-1]["weights"], **{k: v["value"] for k, v in scores.items()}}))
    for seed in [int(s) for s in args.seeds.split(",")]:
        drawn = cfg.model_copy(update={"train": cfg.train.model_copy(update={"seed": seed})})
        model = build_model(drawn, tok.vocab_size, cpu, init=True)
        scores = score_tasks(tasks, model, tok, cfg.data.seq_len, 16, precision)
        rows.append({"weights": f"random init, seed {seed}", "tasks": scores})
        print(json.dumps({"weights": rows[-1]["weights"], **{k: v["value"] for k, v in scores.items()}}))
    print(json.dumps({"run": args.run, "rows": rows}))


if __name__ == "__main__":
    main()
