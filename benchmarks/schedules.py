"""Warmup-cosine against WSD (warmup-stable-decay) at the same budget: final validation loss.

Both runs train the same small Llama-style model on the built-in corpus with the same seed, so the same
initial weights and the same batches in the same order, for the same number of steps at the same peak
learning rate; only ``schedule.name`` differs (cosine decays to ``min_lr_ratio`` of the peak over the whole
run; WSD holds the peak and decays over the last ``schedule.wsd.decay_fraction`` of it, ``1-sqrt`` shape). Each run
evaluates once, at the end, on the same validation tokens. Runs go to a temporary folder; the prepared
corpus is cached under ``data.cache_dir`` as for ``lmforge train``.

    python benchmarks/schedules.py [--config RECIPE.toml] [--SECTION.KEY=VALUE ...]

Defaults (a few minutes a run on 2 CPU cores): 4 x 128 Llama-style model (1.4M parameters with the
4096-token vocabulary), sequences of 128, batches of 16, 400 steps (0.82M tokens), peak lr 3e-3,
warmup 40, fp32, eager, 32768 validation tokens. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from lmforge.recipe import load_config, parse_overrides
from lmforge.train.launch import train

SMALL = {
    "model.n_layers": 4,
    "model.d_model": 128,
    "model.n_heads": 4,
    "data.seq_len": 128,
    "train.micro_batch_size": 16,
    "train.steps": 400,
    "train.compile": False,
    "train.precision": "fp32",
    "train.eval_interval": 0,
    "train.checkpoint_interval": 0,
    "train.log_interval": 50,
    "train.eval_tokens": 32768,
    "train.sample_tokens": 0,
    "optim.lr": 3e-3,
    "schedule.warmup": 40,
}
SCHEDULES = ("cosine", "wsd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", help="TOML recipe (default: the built-in defaults + the small model)")
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    over = {**SMALL, **parse_overrides(extra)}
    results = {}
    for name in SCHEDULES:
        cfg = load_config(args.config, {**over, "schedule.name": name})
        with tempfile.TemporaryDirectory(prefix=f"lmforge-{name}-") as run_dir:
            t = time.perf_counter()
            summary = train(cfg, Path(run_dir), progress_bar=False)
            wall = time.perf_counter() - t
        results[name] = {
            "val_loss": round(summary["val_loss"], 4),
            "val_ppl": round(summary["val_ppl"], 2),
            "wall_s": round(wall, 1),
        }
        print(f"{name:>6}: val_loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f}), {wall:.0f} s")
    s = cfg.schedule
    budget = {
        "steps": cfg.train.steps,
        "tokens": summary["tokens_seen"],
        "parameters": summary["parameters"],
        "peak_lr": cfg.optim.lr,
        "warmup": s.warmup,
        "min_lr_ratio": s.min_lr_ratio,
        "wsd_decay": f"{s.wsd.decay_fraction} {s.wsd.decay_shape}",
        "threads": torch.get_num_threads(),
    }
    diff = results["wsd"]["val_loss"] - results["cosine"]["val_loss"]
    print(f"budget: {budget}")
    print(f"wsd - cosine: {diff:+.4f} nats")
    print(json.dumps({**results, "wsd_minus_cosine": round(diff, 4), "budget": budget}))


if __name__ == "__main__":
    main()
