"""Step time of each clipping mode and of the stability guard, relative to plain global-norm clipping.

Trains the default recipe's model (eager, FP32) on random tokens with ``train_step`` in alternating
rounds: ``norm`` clipping without the guard (the baseline), then with the guard, then the other clip
modes with the guard. Prints the median step time of each and its ratio to the baseline (ratios in the
same run, so the figures stay comparable on a shared machine). The first round only warms up. Then times
the guard's other cost, the host copy of model and optimizer state taken at each checkpoint for
rollbacks (:class:`LastGood`), and the guard's own per-step work (:meth:`Guard.check`: one host
transfer of loss and norm, the spike statistics), each as a fraction of one step: on a shared machine
these direct timings are steadier than the difference of two step times.

    python benchmarks/guard_overhead.py [--rounds 5] [--steps 4] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmforge.config import Config, GuardConfig
from lmforge.data.loader import Batch
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.precision import PrecisionPolicy
from lmforge.train.build import training_module
from lmforge.train.callbacks.guard import Guard, GuardObserver, LastGood
from lmforge.train.step import train_step

VARIANTS = {
    "norm, no guard": ("norm", False),
    "norm + guard": ("norm", True),
    "value + guard": ("value", True),
    "group_norm + guard": ("group_norm", True),
    "adaptive + guard": ("adaptive", True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    cfg, device = Config(), torch.device("cpu")
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    vocab, seq = cfg.data.vocab_size, cfg.data.seq_len
    objective, fp32 = training_module(cfg, vocab, device), PrecisionPolicy("fp32", device)
    model = objective.model
    opt = build_optimizer(model, cfg.optim, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, seq + 1), generator=g)
    batch = [Batch(x[:, :-1], x[:, 1:], torch.zeros(args.batch, seq, dtype=torch.long))]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds + 1):
        for name, (mode, guarded) in VARIANTS.items():
            clipper = Clipper(mode, 1.0, value=1e-3, warmup=1)
            guard = Guard(GuardConfig()) if guarded else None

            def observe(step: int, guard: Guard | None = guard) -> list[GuardObserver]:
                return [GuardObserver(guard, step)] if guard is not None else []

            train_step(objective, opt, batch, 1e-4, clipper, fp32, observe(0))  # warm-up
            start = time.perf_counter()
            for step in range(args.steps):
                train_step(objective, opt, batch, 1e-4, clipper, fp32, observe(step))
            if round_:  # round 0 warms up
                times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["norm, no guard"])
    print(f"{'variant':22} {'ms/step':>9} {'ratio':>7}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:22} {med * 1e3:9.1f} {med / base:7.3f}")
    snapshot, copies = LastGood(), []
    for _ in range(args.rounds):
        start = time.perf_counter()
        snapshot.save({"model": model.state_dict(), "optimizer": opt.state_dict()})
        copies.append(time.perf_counter() - start)
    copy_s = statistics.median(copies)
    print(f"{'last-good snapshot':22} {copy_s * 1e3:9.1f} {copy_s / base:7.3f}  (once per checkpoint)")
    guard, n_checks = Guard(GuardConfig()), 2000
    losses = torch.rand(n_checks, generator=g) + 5.0
    norm = torch.ones(())
    start = time.perf_counter()
    for i in range(n_checks):
        guard.check(i, losses[i], norm)
    check_s = (time.perf_counter() - start) / n_checks
    print(f"{'guard check':22} {check_s * 1e3:9.4f} {check_s / base:7.1e}  (per step)")


if __name__ == "__main__":
    main()
