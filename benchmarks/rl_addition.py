"""The RL demonstration of docs/post-training.md: GRPO, RLOO and PPO teaching a tiny model two-digit addition
from a verifiable reward (``lmforge.posttrain.rewards:addition``: 1 for the exact sum, else 0).

1. ``posttrain/rewards.py::write_addition``: ``--lines`` documents ``"12+34=46"`` for the base model,
   training prompts ``"12+34="`` and ``--val`` held-out prompts whose problems appear nowhere else;
2. ``lmforge train`` of a tiny model on the documents for ``--base-steps`` steps (short on purpose: it
   writes digits and gets some sums right);
3. for each algorithm and seed: ``lmforge rl --from BASE`` (``rl.template = "none"``: the prompt is the
   text after ``<|endoftext|>``, a completion stops at ``<|endoftext|>``) for ``--steps`` steps; the mean
   reward of the sampled completions per step (``rl/reward_mean``) and the greedy held-out reward
   (``val_reward``) at step 0 and every ``--eval-every`` steps;
4. per algorithm, over the seeds: the sampled reward of the first and of the last quarter of the steps
   (``start``, ``end``), their difference and the held-out greedy reward at the last step, each as the
   mean and the sample standard deviation over the seeds.

Usage: ``python benchmarks/rl_addition.py --out DIR [--seeds 0 1 2] [--algorithms grpo rloo ppo]``;
prints the report and writes ``DIR/report-ALGORITHMS-REWARD.json``. Every step runs the real commands in
subprocesses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmforge.posttrain.rewards import write_addition


def lmforge(*args: str) -> float:
    """Run ``lmforge ARGS``; its wall time in seconds (a failure stops the demonstration)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"lmforge {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def base_run(out: Path, files: dict, steps: int) -> Path:
    run = out / "base"
    if not (run / "summary.json").is_file():
        lmforge(
            "train", "--run-dir", str(run),
            f"--data.sources=[{{path='{files['lines']}'}}]", f"--data.cache_dir={out / 'cache'}",
            "--data.vocab_size=300", "--data.seq_len=32", "--data.val_fraction=0.05",
            "--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4",
            f"--train.steps={steps}", "--train.micro_batch_size=32", "--train.precision=fp32",
            "--train.compile=false", "--train.eval_interval=0", "--train.sample_tokens=0",
            "--optim.lr=3e-3", "--schedule.warmup=20",
        )  # fmt: skip
    return run


def rl_run(out: Path, base: Path, files: dict, algorithm: str, seed: int, args) -> dict:
    run = out / f"{algorithm}-{args.reward}-{seed}"
    seconds = lmforge(
        "rl", "--from", str(base), "--run-dir", str(run),
        f"--posttrain.train_files=[\"{files['prompts']}\"]", f"--posttrain.val_files=[\"{files['prompts_val']}\"]",
        f"--rl.algorithm={algorithm}", "--rl.template=none", f"--rl.group_size={args.group}",
        "--rl.max_new_tokens=4", f"--rl.beta={args.beta}", f"--rl.reward=lmforge.posttrain.rewards:{args.reward}",
        f"--train.steps={args.steps}", f"--train.micro_batch_size={args.prompts}", f"--train.seed={seed}",
        "--train.precision=fp32", "--train.compile=false", f"--train.eval_interval={args.eval_every}",
        "--train.log_interval=1", "--train.sample_tokens=0", f"--train.checkpoint_interval={args.steps}",
        f"--optim.lr={args.lr}",
    )  # fmt: skip
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rl/reward_mean" in r]
    evals = {r["step"]: r["val_reward"] for r in records if "val_reward" in r}
    return {
        "seconds": seconds,
        "reward": [r["rl/reward_mean"] for r in steps],
        "kl": [r["rl/kl"] for r in steps],
        "val_reward": evals,
    }


def step0_val(out: Path, base: Path, files: dict, reward: str) -> float:
    """The held-out greedy reward of the base model: ``lmforge eval`` of an RL run's step-0 checkpoint."""
    from lmforge.evaluate.run_loading import evaluate_run

    run = out / f"step0-{reward}"
    if not run.is_dir():
        lmforge(
            "rl", "--from", str(base), "--run-dir", str(run), "--prepare-only",
            f"--posttrain.train_files=[\"{files['prompts']}\"]", f"--posttrain.val_files=[\"{files['prompts_val']}\"]",
            "--rl.template=none", "--rl.max_new_tokens=4", f"--rl.reward=lmforge.posttrain.rewards:{reward}",
            "--train.precision=fp32", "--train.compile=false",
        )  # fmt: skip
    return evaluate_run(run, torch.device("cpu"))["val_reward"]


def seed_summary(per_seed: list[tuple[float, ...]]) -> dict[str, str]:
    """``start``, ``end``, ``rise`` (end - start) and ``held_out`` over the seeds as ``"mean +- std"``
    (the sample standard deviation; 0 for one seed)."""
    out = {}
    for i, name in enumerate(("start", "end", "rise", "held_out")):
        xs = [row[i] for row in per_seed]
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[name] = f"{statistics.fmean(xs):.3f} +- {std:.3f}"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--algorithms", nargs="+", default=["grpo", "rloo", "ppo"])
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--base-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--reward", default="addition", help="addition (exact) or addition_digits (partial)")
    p.add_argument("--eval-every", type=int, default=20)
    args = p.parse_args()
    out = Path(args.out)
    files = write_addition(out / "data", args.lines, 1000, args.val, seed=0)
    start = time.perf_counter()
    base = base_run(out, files, args.base_steps)
    report = {
        "base_seconds": time.perf_counter() - start,
        "val_reward_step0": step0_val(out, base, files, args.reward),
    }
    print(f"base: {report['base_seconds']:.0f} s, held-out greedy reward {report['val_reward_step0']:.3f}")
    for algorithm in args.algorithms:
        per_seed = []
        for seed in args.seeds:
            r = rl_run(out, base, files, algorithm, seed, args)
            report[f"{algorithm}-{seed}"] = r
            w = max(1, len(r["reward"]) // 4)
            first, last = sum(r["reward"][:w]) / w, sum(r["reward"][-w:]) / w
            held = r["val_reward"].get(args.steps, float("nan"))
            per_seed.append((first, last, last - first, held))
            print(
                f"{algorithm} seed {seed}: sampled reward, first {w} steps {first:.3f} -> last {w} {last:.3f}; "
                f"held-out {r['val_reward']}; {r['seconds']:.0f} s"
            )
        report[algorithm] = summary = seed_summary(per_seed)
        print(
            f"{algorithm} over {len(args.seeds)} seeds (mean +- sample std): start {summary['start']}, "
            f"end {summary['end']}, rise {summary['rise']}, held-out at step {args.steps} {summary['held_out']}"
        )
    (out / f"report-{'-'.join(args.algorithms)}-{args.reward}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
