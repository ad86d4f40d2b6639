"""Quantization-aware training against post-training quantization, over seeds.

The small model of ``configs/experiment-small.toml`` (2 x 32 Llama-style, the built-in corpus, 60 steps
of 4 x 64 tokens) is trained twice per seed with the same batches, schedule and optimizer: in full
precision (fp32), and with QAT (``[qat]``: the blocks' linear layers fake-quantized as ``--scheme``, from
step ``--start-step`` on). Each finished run is exported with ``lmforge export --quantize`` (the
torchao integer model, ``evaluate/quantized_export.py``) and scored on the same held-out tokens:

* (a) fp32: the full-precision run's own weights;
* (b) PTQ: the full-precision run quantized after training;
* (c) QAT: the QAT run quantized (the model its training simulated);
* and, for reference, the QAT run's full-precision weights without quantization.

Each seed trains fp32 first, then QAT, so the machine's load falls on both alike; ``--jobs N`` trains N
seeds at once, one process each (the wall-time ratio is then still taken between arms run side by side). Printed: every run's
scores and wall time; then per column the mean and sample standard deviation over seeds, and two-sided
Welch t-tests (``lmforge.experiment.stats.welch_test``) of (b) against (a) (what quantizing costs) and
of (c) against (b) (what QAT recovers), and the QAT / fp32 training wall-time ratio measured in this run.
The last line printed is one JSON object.

    python benchmarks/qat.py [--seeds 1,2,3] [--scheme int8da-int4w] [--group-size 32] [--start-step 20]
                             [--jobs 3] [--SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import torch

from lmforge.evaluate.quantized_export import export_quantized
from lmforge.evaluate.run_loading import evaluate_run
from lmforge.experiment.stats import welch_test
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.launch import train

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "experiment-small.toml"
COLUMNS = ("fp32", "ptq", "qat", "qat_fp32")


def spread(values: list[float]) -> tuple[float, float]:
    """``(mean, s)``: the mean and the sample standard deviation ``sqrt(sum (x - mean)^2 / (n - 1))``."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_seed(seed: int, base: dict, qat: dict, root: Path, args: dict) -> dict:
    """One seed: the fp32 run, then the QAT run, each trained, exported as ``--scheme`` and scored."""
    logging.basicConfig(level=logging.WARNING)
    out: dict = {}
    for arm, over in (("fp32", {}), ("qat", qat)):
        cfg = load_config(RECIPE, {**base, **over, "train.seed": seed})
        run = root / f"{arm}-{seed}"
        t0 = time.perf_counter()
        summary = train(cfg, run, progress_bar=False)
        out["wall_" + arm] = time.perf_counter() - t0
        out["tokens"] = summary["tokens_seen"]
        quantized = export_quantized(run, args["scheme"], args["group_size"])
        cpu = torch.device("cpu")
        full = evaluate_run(run, cpu, args["eval_tokens"])["val_loss"]  # the plain model: no fake quantizers
        integer = evaluate_run(quantized, cpu, args["eval_tokens"])["val_loss"]
        out["fp32" if arm == "fp32" else "qat_fp32"] = full
        out["ptq" if arm == "fp32" else "qat"] = integer
        print(
            f"seed {seed} {arm}: full precision {full:.4f}, {args['scheme']} {integer:.4f}, "
            f"{out['tokens']:,} tokens, training {out['wall_' + arm]:.0f} s",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    ap.add_argument("--scheme", default="int8da-int4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--start-step", type=int, default=20, help="qat.start_step of the QAT runs")
    ap.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens each score reads")
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    ap.add_argument("--run-root", default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds trained at once, one process each")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = {
        "data.cache_dir": args.cache_dir,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
        **parse_overrides(extra),
    }
    qat = {
        "qat.enabled": True,
        "qat.scheme": args.scheme,
        "qat.group_size": args.group_size,
        "qat.start_step": args.start_step,
    }
    root = Path(args.run_root) if args.run_root else Path(tempfile.mkdtemp(prefix="lmforge-qat-"))
    job = partial(run_seed, base=base, qat=qat, root=root, args=vars(args))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = dict(zip(seeds, pool.map(job, seeds), strict=True))
    else:
        results = {seed: job(seed) for seed in seeds}
    scores = {c: {seed: results[seed][c] for seed in seeds} for c in COLUMNS}
    wall = {arm: {seed: results[seed]["wall_" + arm] for seed in seeds} for arm in ("fp32", "qat")}
    tokens = results[seeds[0]]["tokens"]
    out: dict = {
        "scheme": args.scheme,
        "group_size": args.group_size,
        "start_step": args.start_step,
        "seeds": seeds,
        "tokens": tokens,
        "eval_tokens": args.eval_tokens,
    }
    for column in COLUMNS:
        mean, s = spread([scores[column][seed] for seed in seeds])
        print(f"{column:9s}: val_loss {mean:.4f} +- {s:.4f} (n={len(seeds)})")
        out[column] = {"mean": mean, "sd": s, "values": [scores[column][seed] for seed in seeds]}
    for a, b in (("fp32", "ptq"), ("ptq", "qat"), ("fp32", "qat")):
        welch = welch_test([scores[a][s] for s in seeds], [scores[b][s] for s in seeds])
        diffs = [scores[b][s] - scores[a][s] for s in seeds]
        d_mean, d_sd = spread(diffs)
        p = "n/a" if welch.p is None else f"{welch.p:.3g}"
        print(f"{b} - {a}: {d_mean:+.4f} +- {d_sd:.4f} per seed; Welch p = {p}")
        out[f"{b}_minus_{a}"] = {"mean": d_mean, "sd": d_sd, "welch_p": welch.p}
    ratio = spread(list(wall["qat"].values()))[0] / spread(list(wall["fp32"].values()))[0]
    print(f"training wall time qat / fp32: {ratio:.2f}x (measured in this run, same machine and load)")
    out["wall_s"] = {arm: spread(list(v.values()))[0] for arm, v in wall.items()}
    out["wall_ratio"] = ratio
    print(json.dumps(out))


if __name__ == "__main__":
    main()
