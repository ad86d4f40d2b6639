"""DDP gradient compression (``parallel.ddp_comm_hook``): bytes each rank hands to the gradient all-reduce
per step, and the validation loss, for each hook against none, over several seeds.

Run under torchrun (2 processes, gloo on CPU); every arm builds the same small Llama-style model through
lmforge's build (``train/build.py``: DDP with the arm's hook) and trains it with lmforge's trainer on the
built-in corpus, same seeds, same batches, AdamW, FP32; arms are interleaved within each seed. Printed per
arm: bytes per step (PowerSGD's after its uncompressed start), the ratio to none, the final validation loss
(mean and sample standard deviation over seeds, the Welch p-value against none:
``lmforge/experiment/stats.py``) and the wall time relative to none (measured in the same
launch, so load on the machine scales every arm alike, roughly), then one JSON object.

    torchrun --nproc-per-node=2 benchmarks/comm_compression.py [--steps 60] [--seeds 1,2,3]
        [--hooks none,bf16,fp16,powersgd] [--SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from lmforge.experiment.stats import welch_test
from lmforge.parallel.layout import end_process_group
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.build import build_run
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.evaluation import validation_loss
from lmforge.train.trainer import Trainer

HOOKS = ("none", "bf16", "fp16", "powersgd")


class SteadyBytes(Callback):
    """Drops the byte count of the first ``warm`` steps (PowerSGD's uncompressed start) and keeps losses."""

    def __init__(self, warm: int) -> None:
        self.warm, self.losses = warm, []

    def on_step_end(self, trainer: Trainer, result) -> None:
        self.losses.append(float(result.loss))
        if trainer.progress.step == self.warm:
            trainer.run.comm.take_bytes_per_step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--hooks", default=",".join(HOOKS))
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--powersgd-rank", type=int, default=4)
    ap.add_argument("--powersgd-start", type=int, default=10)
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    hooks = [h.strip() for h in args.hooks.split(",") if h.strip()]
    if any(h not in HOOKS for h in hooks):
        ap.error(f"--hooks: choose from {', '.join(HOOKS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    base = {
        "data.cache_dir": args.cache_dir,
        "data.vocab_size": 1024,
        "data.seq_len": args.seq_len,
        "model.d_model": args.d_model,
        "model.n_layers": args.n_layers,
        "model.n_heads": 4,
        "train.steps": args.steps,
        "train.micro_batch_size": args.batch,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_tokens": 16384,
        "schedule.warmup": 0.1,
        "parallel.dp_replicate": 2,
        "parallel.powersgd.rank": args.powersgd_rank,
        "parallel.powersgd.start_step": args.powersgd_start,
        **parse_overrides(extra),
    }
    results: dict[str, dict[str, list]] = {h: {"bytes": [], "val_loss": [], "wall_s": []} for h in hooks}
    main_rank = True
    for seed in seeds:
        for hook in hooks:
            cfg = load_config(None, {**base, "parallel.ddp_comm_hook": hook, "train.seed": seed})
            run = build_run(cfg)
            main_rank = run.layout.is_main
            steady = SteadyBytes(args.powersgd_start if hook == "powersgd" else 0)
            trainer = Trainer(run, [steady])
            t0 = time.perf_counter()
            trainer.fit()
            wall = time.perf_counter() - t0
            loss = validation_loss(trainer)
            r = results[hook]
            r["bytes"].append(run.comm.take_bytes_per_step())
            r["val_loss"].append(loss)
            r["wall_s"].append(wall)
            if main_rank:
                print(
                    f"seed {seed} {hook:9s} bytes/step {r['bytes'][-1]:>10.0f} val_loss {loss:.4f} {wall:.1f}s",
                    flush=True,
                )
    end_process_group()
    if not main_rank:
        return
    none = results.get("none")
    out: dict = {"steps": args.steps, "seeds": seeds, "d_model": args.d_model, "n_layers": args.n_layers,
                 "powersgd": {"rank": args.powersgd_rank, "start_step": args.powersgd_start}, "hooks": {}}  # fmt: skip
    for hook, r in results.items():
        row = {
            "bytes_per_step": statistics.mean(r["bytes"]),
            "val_loss_mean": statistics.mean(r["val_loss"]),
            "val_loss_sd": statistics.stdev(r["val_loss"]) if len(r["val_loss"]) > 1 else 0.0,
            "val_loss": r["val_loss"],
        }
        if none is not None:
            row["bytes_ratio"] = row["bytes_per_step"] / statistics.mean(none["bytes"])
            row["wall_ratio"] = sum(r["wall_s"]) / sum(none["wall_s"])
            row["val_loss_diff"] = [a - b for a, b in zip(r["val_loss"], none["val_loss"], strict=True)]
            row["p_welch"] = welch_test(none["val_loss"], r["val_loss"]).p
        out["hooks"][hook] = row
        print(
            f"{hook:9s} bytes/step {row['bytes_per_step']:>10.0f} ({row.get('bytes_ratio', 1):.3f}x)  "
            f"val_loss {row['val_loss_mean']:.4f} +- {row['val_loss_sd']:.4f}  p {row.get('p_welch')}  "
            f"wall {row.get('wall_ratio', 1):.2f}x"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
