"""Step time of SOAP against AdamW on one model, measured inside one process.

The model of ``configs/experiment-small.toml`` by default (Llama-style, 2 layers, d_model 32, 4 heads,
vocab 4096; batch 4 x 64 tokens, FP32, eager), built twice from the same seed, one with
``optim.name = "adamw"`` (torch's fused kernel), one with ``"soap"`` (``--max-precond-dim``, default
1024: the 4096-row embedding rotated on its 32-wide side only, as in ``docs/results.md``). Each step, the
two models take one training step in turn (forward, backward, optimizer step) on the same batch, so a
shared machine's load falls on both alike; after ``--warmup`` steps, the optimizer step alone and the
whole training step are timed. SOAP refreshes its bases every ``--frequency`` steps, inside the timed
window. One torch thread (``--threads``): on a loaded 2-core machine, two threads make ``eigh`` and QR
many times slower (OpenMP threads waiting on each other).

    python benchmarks/soap_step_time.py [--steps 30] [--warmup 2] [--frequency 10] [--max-precond-dim 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--max-precond-dim", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, vocab, seq = ModelConfig(n_layers=2, d_model=32, n_heads=4), 4096, 64
    soap = {"precondition_frequency": args.frequency, "max_precond_dim": args.max_precond_dim}
    runs = {}
    for name in ("adamw", "soap"):
        torch.manual_seed(0)
        model = Transformer(cfg, vocab, seq)
        model.init_weights()
        opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, soap=soap), torch.device("cpu"))
        runs[name] = (NextTokenLoss(model), opt, {"optimizer step": 0.0, "training step": 0.0})
    x = torch.randint(0, vocab, (4, seq + 1), generator=torch.Generator().manual_seed(0))
    for i in range(args.steps):
        for objective, opt, times in runs.values():
            start = time.perf_counter()
            loss, n = objective(x[:, :-1], x[:, 1:])
            (loss / n).backward()
            middle = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            if i >= args.warmup:
                times["optimizer step"] += end - middle
                times["training step"] += end - start
    timed = args.steps - args.warmup
    for name, (_, _, times) in runs.items():
        print(name, ", ".join(f"{k} {v / timed * 1e3:.1f} ms" for k, v in times.items()))
    a, s = runs["adamw"][2], runs["soap"][2]
    print(", ".join(f"{k}: soap / adamw {s[k] / a[k]:.2f}x" for k in a), f"({timed} timed steps each)")


if __name__ == "__main__":
    main()
