"""Gradient noise, gradient centralization, weight decay by depth and cautious weight decay, each against
plain AdamW at equal steps on the built-in corpus (one seed: a first look, not a significance test).

Every arm trains the same small Llama-style model from the same initialisation on the same batches
(``builtin:pystdlib``, ``train.seed``) with the same schedule (10% warmup, cosine to 10%), AdamW at
``optim.lr`` 3e-3, weight decay 0.1 on matrices, clipping at 1.0, FP32, through lmforge's own loop; only
the arm's keys differ. Printed: each arm's final validation loss and wall time, then one JSON object.

    python benchmarks/grad_techniques.py [--steps 150] [--d-model 64] [--n-layers 4] [--SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from lmforge.recipe import load_config, parse_overrides
from lmforge.train.launch import train

ARMS = {
    "baseline": {},
    "grad_noise": {"optim.grad_noise.eta": 0.01},
    "grad_centralization": {"optim.grad_centralization": True},
    "depth_decay": {"optim.depth_decay.first": 0.0, "optim.depth_decay.last": 2.0},
    "cautious_weight_decay": {"optim.cautious_weight_decay": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, from: " + ", ".join(ARMS))
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    base = {
        "data.cache_dir": args.cache_dir,
        "data.seq_len": args.seq_len,
        "model.d_model": args.d_model,
        "model.n_layers": args.n_layers,
        "model.n_heads": 4,
        "train.steps": args.steps,
        "train.micro_batch_size": args.batch,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": args.steps,
        "train.eval_tokens": 8192,
        "train.checkpoint_interval": 0,
        "train.log_interval": args.steps,
        "train.sample_tokens": 0,
        "schedule.warmup": 0.1,
        **parse_overrides(extra),
    }
    names = [n.strip() for n in args.arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    root = Path(tempfile.mkdtemp(prefix="lmforge-techniques-"))
    out: dict = {"steps": args.steps, "d_model": args.d_model, "n_layers": args.n_layers, "arms": {}}
    for name in names:
        cfg = load_config(None, {**base, **ARMS[name]})
        t0 = time.perf_counter()
        summary = train(cfg, root / name, progress_bar=False)
        wall = time.perf_counter() - t0
        out["seed"] = cfg.train.seed
        out["arms"][name] = {"val_loss": round(summary["val_loss"], 4), "wall_s": round(wall, 1)}
        print(f"{name:22s} val_loss {summary['val_loss']:.4f}  {wall:.0f}s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
