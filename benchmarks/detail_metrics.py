"""Cost of the detail records (``metrics.detail_interval``): training time with them against without.

Builds the default recipe's run (4 layers, d_model 256, seq_len 256, FP32, eager; ``--SECTION.KEY=VALUE``
overrides apply) through lmforge's build path, then trains the same model with the trainer and only the
:class:`DetailMetrics` callback in alternating blocks of ``--steps`` steps: ``detail_interval = 0`` and
``detail_interval = --interval`` (default 50), the order swapped every round, after a few warm-up
steps. A block of ``--steps`` steps at interval 50 holds ``steps // 50`` detail steps, so the ratio of the two
block times is the overhead at that interval. Printed: the median block time of each, the median of the
per-round ratios, and the callback's own time on its detail steps (its hooks timed directly) as a fraction
of the blocks without it: on a shared machine this direct figure is steadier than a difference of two
wall times.

    python benchmarks/detail_metrics.py [--steps 50] [--rounds 3] [--interval 50] [--SECTION.KEY=VALUE ...]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from lmforge.recipe import load_config, parse_overrides
from lmforge.train.build import build_run
from lmforge.train.callbacks.detail import DetailMetrics
from lmforge.train.trainer import Trainer


class TimedDetail(DetailMetrics):
    """:class:`DetailMetrics` with the wall time of its hooks added up."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def _timed(self, hook, *args):
        start = time.perf_counter()
        out = hook(*args)
        self.seconds += time.perf_counter() - start
        return out

    def on_batches(self, trainer, batches):
        return self._timed(super().on_batches, trainer, batches)

    def veto(self, trainer, loss, grad_norm):
        return self._timed(super().veto, trainer, loss, grad_norm)

    def on_step_end(self, trainer, result):
        return self._timed(super().on_step_end, trainer, result)


def train_block(run, cfg, steps: int) -> tuple[float, float, int]:
    """Train ``steps`` steps of ``run`` under ``cfg``: (wall seconds, the callback's seconds, records)."""
    run.cfg = cfg
    records: list[dict] = []
    detail = TimedDetail()
    trainer = Trainer(run, [detail])
    trainer.total_steps = steps
    trainer.log = records.append
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start, detail.seconds, len(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="steps of each timed block")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after a few warm-up steps)")
    ap.add_argument("--interval", type=int, default=50, help="metrics.detail_interval of the measured side")
    ap.add_argument("--config", default=None, help="a recipe (default: the built-in defaults)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    over = {
        "train.compile": False,
        "train.precision": "fp32",
        "train.checkpoint_interval": 0,
        **parse_overrides(extra),
    }
    base = load_config(args.config, over)
    run = build_run(base)
    m = base.model
    print(
        f"model: {m.arch} {m.n_layers} layers, d_model {m.d_model}; {base.train.micro_batch_size} x "
        f"{base.data.seq_len} tokens per step; {args.steps} steps per block, device {run.device}",
        flush=True,
    )
    variants = {
        "off": base.model_copy(update={"metrics": base.metrics.model_copy(update={"detail_interval": 0})}),
        "on": base.model_copy(
            update={"metrics": base.metrics.model_copy(update={"detail_interval": args.interval})}
        ),
    }
    times: dict[str, list[float]] = {"off": [], "on": []}
    ratios, direct, n_records = [], [], 0
    train_block(run, variants["off"], min(args.steps, 5))  # warm-up: first-step costs, caches
    for round_ in range(1, args.rounds + 1):
        order = ["off", "on"] if round_ % 2 else ["on", "off"]
        got = {}
        for name in order:
            got[name] = train_block(run, variants[name], args.steps)
        for name in times:
            times[name].append(got[name][0])
        ratios.append(got["on"][0] / got["off"][0])
        direct.append(got["on"][1] / got["off"][0])
        n_records = got["on"][2]
        print(
            f"round {round_}: off {got['off'][0]:.2f}s, on {got['on'][0]:.2f}s "
            f"(ratio {ratios[-1]:.4f}; callback {got['on'][1]:.3f}s)",
            flush=True,
        )
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratio, own = statistics.median(ratios), statistics.median(direct)
    print(f"{'interval':>10} {'s/block':>9} {'ms/step':>9}")
    print(f"{0:>10} {off:9.2f} {off / args.steps * 1e3:9.1f}")
    print(f"{args.interval:>10} {on:9.2f} {on / args.steps * 1e3:9.1f}")
    print(f"overhead (median ratio of wall times): {(ratio - 1) * 100:+.2f}%")
    print(f"overhead (the callback's own time): {own * 100:.2f}%  ({n_records} record(s) per block)")
    summary = {
        "interval": args.interval,
        "steps_per_block": args.steps,
        "records_per_block": n_records,
        "s_per_step_off": off / args.steps,
        "s_per_step_on": on / args.steps,
        "overhead_wall": ratio - 1,
        "overhead_callback": own,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
