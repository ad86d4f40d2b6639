"""The RL demonstration of docs/post-training.md: GRPO, RLOO and PPO teaching a tiny model two-digit addition
from a verifiable reward (``lmforge.posttrain.rewards:addition``: 1 for the exact sum, else 0;
``addition_digits``: the share of right digits).

1. ``posttrain/rewards.py::write_addition``: ``--lines`` documents ``"12+34=46"`` for the base model,
   training prompts ``"12+34="`` and ``--val`` held-out prompts whose problems appear nowhere else;
2. ``lmforge train`` of a tiny model on the documents for ``--base-steps`` steps (long enough that it
   writes the exact sum for a good share of the held-out problems, short of all of them);
3. for each algorithm and seed: ``lmforge rl --from BASE`` (``rl.template = "none"``: the prompt is the
   text after ``<|endoftext|>``, a completion stops at ``<|endoftext|>``) for ``--steps`` steps; the mean
   reward of the sampled completions per step (``rl/reward_mean``) and the greedy held-out reward
   (``val_reward``) at step 0 and every ``--eval-every`` steps;
4. the **sampled held-out reward** of the base and of each run's last checkpoint: ``--val-samples``
   completions of every held-out prompt at the runs' temperature (``--temperature``), drawn with one fixed
   seed, so the base's figure is one number and a run's differs from it only by what RL changed;
5. per algorithm, over the seeds (mean and sample standard deviation, and a two-sided one-sample t-test
   with ``n - 1`` degrees of freedom, ``lmforge.experiment.stats.one_sample_test``): the sampled training
   reward of the first and of the last quarter of the steps and its rise (tested against 0); the sampled
   and the greedy held-out reward at the last step (each tested against the base's, a constant: the base
   run is shared and its evaluation deterministic).

Usage: ``python benchmarks/rl_addition.py --out DIR [--seeds 0 1 2] [--algorithms grpo rloo ppo]``;
prints the report, writes ``DIR/report-ALGORITHMS-REWARD.json`` and the reward curves
``DIR/reward-ALGORITHMS-REWARD.png``. Every step runs the real commands in subprocesses. The defaults are
the setting of docs/results.md ("RL on the addition task").
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

from lmforge.experiment.stats import one_sample_test
from lmforge.posttrain import rewards
from lmforge.posttrain.rewards import write_addition


def lmforge(*args: str) -> float:
    """Run ``lmforge ARGS``; its wall time in seconds (a failure stops the demonstration)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"lmforge {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def base_run(out: Path, files: dict, steps: int, vocab: int) -> Path:
    run = out / "base"
    if not (run / "summary.json").is_file():
        lmforge(
            "train", "--run-dir", str(run),
            f"--data.sources=[{{path='{files['lines']}'}}]", f"--data.cache_dir={out / 'cache'}",
            f"--data.vocab_size={vocab}", "--data.seq_len=32", "--data.val_fraction=0.05",
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
        "--rl.max_new_tokens=4", f"--rl.beta={args.beta}", f"--rl.temperature={args.temperature}",
        f"--rl.reward=lmforge.posttrain.rewards:{args.reward}",
        f"--train.steps={args.steps}", f"--train.micro_batch_size={args.prompts}", f"--train.seed={seed}",
        "--train.precision=fp32", "--train.compile=false", f"--train.eval_interval={args.eval_every}",
        "--train.log_interval=1", "--train.sample_tokens=0", f"--train.checkpoint_interval={args.steps}",
        f"--optim.lr={args.lr}", f"--schedule.warmup={args.warmup}",
    )  # fmt: skip
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rl/reward_mean" in r]
    evals = {r["step"]: r["val_reward"] for r in records if "val_reward" in r}
    return {
        "run": str(run),
        "seconds": seconds,
        "reward": [r["rl/reward_mean"] for r in steps],
        "kl": [r["rl/kl"] for r in steps],
        "entropy": [r["rl/entropy"] for r in steps],
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


@torch.no_grad()
def sampled_val_reward(run: Path, prompts_file: str, reward: str, temperature: float, samples: int) -> float:
    """The mean reward of ``samples`` completions (at most 4 tokens, as the runs) of every held-out prompt,
    sampled at ``temperature`` from ``run``'s newest checkpoint with the fixed seed 0: the prompt ids as
    ``rl.template = "none"`` builds them (``<|endoftext|>`` and the text), a completion ending at
    ``<|endoftext|>``, scored by ``lmforge.posttrain.rewards.REWARD`` as the runs score theirs."""
    from lmforge.evaluate.run_loading import load_run
    from lmforge.model.sampling import generate_batch

    _, tok, model, _ = load_run(run, torch.device("cpu"))
    score = getattr(rewards, reward)
    texts = [json.loads(line)["prompt"] for line in Path(prompts_file).read_text().splitlines()]
    rows = [[tok.eot_id, *tok.encode(t)] for t in texts for _ in range(samples)]
    out = generate_batch(model, rows, 4, temperature, 0, 1.0, (tok.eot_id,), seed=0)
    prompts = [t for t in texts for _ in range(samples)]
    return sum(score(p, tok.decode(o)) for p, o in zip(prompts, out, strict=True)) / len(out)


def test_line(values: list[float], against: float | None = None) -> str:
    """``"mean +- sd"`` of ``values`` and, given ``against``, ``" (p P)"``: the two-sided one-sample t-test
    of ``values`` against it."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    p = None if against is None else one_sample_test(values, against).p
    return f"{statistics.fmean(values):.3f} +- {sd:.3f}" + (f" (p {p:.2g})" if p is not None else "")


def moving_mean(xs: list[float], w: int) -> list[float]:
    """The mean of each window of ``w`` consecutive values (``len(xs) - w + 1`` of them)."""
    return [sum(xs[i : i + w]) / w for i in range(len(xs) - w + 1)]


def plot(path: Path, report: dict, algorithms: list[str], seeds: list[int], window: int) -> None:
    """Each algorithm's sampled training reward (moving mean over ``window`` steps; one thin line per seed,
    a thick one for their mean), the base's sampled held-out reward (dashed) and each run's at its end."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, algorithm in enumerate(algorithms):
        color = f"C{i}"
        curves = [moving_mean(report[f"{algorithm}-{s}"]["reward"], window) for s in seeds]
        x = list(range(window, window + len(curves[0])))
        for c in curves:
            ax.plot(x, c, color=color, alpha=0.3, lw=0.8)
        ax.plot(
            x, [statistics.fmean(v) for v in zip(*curves, strict=True)], color=color, lw=2, label=algorithm
        )
        end = [report[f"{algorithm}-{s}"]["val_sampled"] for s in seeds]
        ax.scatter([x[-1] + 4 + 2 * i] * len(end), end, color=color, marker="o", s=18, zorder=3)
    ax.axhline(report["val_sampled_base"], color="k", ls="--", lw=1, label="base, sampled held-out reward")
    ax.set_xlabel(f"step (sampled training reward: mean of the last {window} steps)")
    ax.set_ylabel("reward")
    ax.set_title("RL on two-digit addition; dots: sampled held-out reward at the end, per seed")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--algorithms", nargs="+", default=["grpo", "rloo", "ppo"])
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--val", type=int, default=200)
    p.add_argument("--base-steps", type=int, default=600, help="steps of the base run")
    p.add_argument(
        "--vocab",
        type=int,
        default=260,
        help="data.vocab_size of the base run: 260 is the bytes, <|endoftext|> and 3 merges, so a number is "
        "about one token a digit (at 300 most digit pairs are one token and the sum's last digit is learned "
        "much later)",
    )
    p.add_argument("--steps", type=int, default=300, help="steps of each RL run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per RL step (train.micro_batch_size)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (rl.group_size)")
    p.add_argument("--beta", type=float, default=0.04, help="rl.beta: weight of the KL penalty")
    p.add_argument("--lr", type=float, default=2e-4, help="optim.lr: peak learning rate of the RL runs")
    p.add_argument("--warmup", type=int, default=20, help="schedule.warmup of the RL runs (steps)")
    p.add_argument("--temperature", type=float, default=1.0, help="rl.temperature: sampling temperature")
    p.add_argument("--reward", default="addition", help="addition (exact) or addition_digits (partial)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument(
        "--val-samples",
        type=int,
        default=64,
        help="completions per held-out prompt in the sampled held-out reward",
    )
    args = p.parse_args()
    out = Path(args.out)
    files = write_addition(out / "data", args.lines, 1000, args.val, seed=0)
    start = time.perf_counter()
    base = base_run(out, files, args.base_steps, args.vocab)
    report = {
        "args": vars(args),
        "base_seconds": time.perf_counter() - start,
        "val_reward_step0": step0_val(out, base, files, args.reward),
    }
    sampled = lambda run: sampled_val_reward(  # noqa: E731
        run, files["prompts_val"], args.reward, args.temperature, args.val_samples
    )
    report["val_sampled_base"] = base_sampled = sampled(base)
    print(
        f"base: {report['base_seconds']:.0f} s, held-out reward greedy {report['val_reward_step0']:.3f}, "
        f"sampled {base_sampled:.3f}"
    )
    for algorithm in args.algorithms:
        rows = []
        for seed in args.seeds:
            r = rl_run(out, base, files, algorithm, seed, args)
            r["val_sampled"] = sampled(Path(r["run"]))
            report[f"{algorithm}-{seed}"] = r
            w = max(1, len(r["reward"]) // 4)
            first, last = sum(r["reward"][:w]) / w, sum(r["reward"][-w:]) / w
            held = r["val_reward"].get(args.steps, float("nan"))
            rows.append((first, last, last - first, r["val_sampled"], held))
            print(
                f"{algorithm} seed {seed}: sampled reward, first {w} steps {first:.3f} -> last {w} {last:.3f}; "
                f"held-out sampled {r['val_sampled']:.3f}, greedy {r['val_reward']}; {r['seconds']:.0f} s"
            )
        cols = [list(c) for c in zip(*rows, strict=True)]
        report[algorithm] = summary = {
            "start": test_line(cols[0]),
            "end": test_line(cols[1]),
            "rise": test_line(cols[2], 0.0),
            "held_out_sampled": test_line(cols[3], base_sampled),
            "held_out_greedy": test_line(cols[4], report["val_reward_step0"]),
        }
        print(
            f"{algorithm} over {len(args.seeds)} seeds (mean +- sample sd; p: one-sample t-test): sampled "
            f"training reward, first quarter {summary['start']}, last quarter {summary['end']}, rise "
            f"{summary['rise']}; at step {args.steps} held-out sampled {summary['held_out_sampled']} against "
            f"the base's {base_sampled:.3f}, greedy {summary['held_out_greedy']} against "
            f"{report['val_reward_step0']:.3f}"
        )
    name = f"{'-'.join(args.algorithms)}-{args.reward}"
    (out / f"report-{name}.json").write_text(json.dumps(report, indent=1))
    plot(out / f"reward-{name}.png", report, args.algorithms, args.seeds, max(1, args.steps // 10))


if __name__ == "__main__":
    main()
