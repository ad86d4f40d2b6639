"""The post-training demonstration of docs/post-training.md, end to end on the built-in corpus.

From a pretrained run (the built-in default, ``lmforge train``):

1. ``lmforge data stdlib-pairs``: SFT records (a question about a standard-library function, class or
   module, answered by its docstring) and DPO pairs (the right docstring chosen, another object's
   rejected), whole modules held out for evaluation;
2. ``lmforge sft --from RUN``: held-out response loss before (the step-0 checkpoint: the pretrained weights
   with the chat tokens added) and after;
3. ``lmforge dpo --from SFT_RUN`` on ``--dpo-pairs`` training pairs drawn from all of them: held-out reward
   accuracy and margin (``val_rewards/...``) before (step 0: the reference itself, accuracy 0, margin 0)
   and after;
4. five held-out questions answered greedily before SFT, after SFT and after DPO.

Usage: ``python benchmarks/post_training.py RUN --out DIR [--sft-steps N] [--dpo-steps N]``; prints the
report and writes ``DIR/report.json``. Every step runs the real commands in subprocesses, as a user would.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmforge.evaluate.run_loading import evaluate_posttrain, pick_checkpoint
from lmforge.posttrain.records import Turn, read_examples
from lmforge.posttrain.template import read_template
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_saved_config
from lmforge.train.checkpoint import load_checkpoint


def lmforge(*args: str) -> float:
    """Run ``lmforge ARGS``; its wall time in seconds (a failure stops the demonstration)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"lmforge {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def load_at(run: Path, step: int | None):
    """(config, model) of ``run``'s checkpoint ``step`` (newest when None), on the CPU."""
    from lmforge.tokenizer import Tokenizer
    from lmforge.train.build import build_model

    ckpt = pick_checkpoint(run, step)
    cfg = load_saved_config(ckpt / "config.toml")
    model = build_model(cfg, Tokenizer(run / "tokenizer.json").vocab_size, torch.device("cpu"), init=False)
    model.load_state_dict(load_checkpoint(ckpt)["model"])
    return cfg, model.eval()


def held_out(run: Path, step: int | None) -> dict:
    """The held-out figures of ``run`` at checkpoint ``step``, scored as training scores them: in the run's
    precision (a DPO run's cached reference was scored in it; in FP32 the step-0 margin is BF16's rounding,
    not 0)."""
    cfg, model = load_at(run, step)
    return evaluate_posttrain(
        cfg, model, run, PrecisionPolicy.resolve(cfg.train.precision, torch.device("cpu"))
    )


def answers(run: Path, step: int | None, questions: list[str], n: int) -> list[str]:
    """Greedy answers (up to ``n`` tokens) of ``run``'s model to ``questions`` through its chat template."""
    from lmforge.model.sampling import generate
    from lmforge.tokenizer import Tokenizer

    _, model = load_at(run, step)
    template, tok = read_template(run), Tokenizer(run / "tokenizer.json")
    out = []
    for q in questions:
        ids = generate(
            model, template.prompt_ids([Turn("user", q)]), n, temperature=0.0, stop_token=template.end_id
        )
        out.append(tok.decode([i for i in ids if i != template.end_id]).strip())
    return out


def sample_lines(src: Path, dst: Path, n: int, seed: int = 0) -> Path:
    """``n`` lines of ``src`` drawn without replacement (seeded), in their file order, written to ``dst``."""
    lines = src.read_text().splitlines(keepends=True)
    keep = sorted(random.Random(seed).sample(range(len(lines)), min(n, len(lines))))
    dst.write_text("".join(lines[i] for i in keep))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the pretrained run folder")
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for the pairs, the runs and the report"
    )
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--dpo-steps", type=int, default=200)
    parser.add_argument(
        "--dpo-pairs",
        type=int,
        default=1600,
        help="training pairs drawn for DPO (default: one epoch of 200 steps x 8 pairs; the reference scores "
        "only these)",
    )
    parser.add_argument("--dpo-lr", type=float, default=None, help="optim.lr of the DPO run (default: dpo's)")
    parser.add_argument(
        "--val-records", type=int, default=0, help="held-out records drawn for evaluation (default: all)"
    )
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--answer-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out, pairs = args.out, args.out / "pairs"
    sft_run, dpo_run = out / "sft", out / "dpo"
    times = {"pairs_s": lmforge("data", "stdlib-pairs", "--out", str(pairs))}
    stats = json.loads((pairs / "stats.json").read_text())
    for kind in ("sft", "dpo"):  # the same held-out records for both (the files are line-aligned)
        if args.val_records:
            sample_lines(pairs / f"{kind}_val.jsonl", pairs / f"{kind}_val.jsonl", args.val_records)
    files = lambda kind, split: f'["{(pairs / f"{kind}_{split}.jsonl").resolve()}"]'  # noqa: E731
    val, _ = read_examples([pairs / "sft_val.jsonl"])
    chosen = val[:: max(1, len(val) // args.samples)][: args.samples]
    questions = [e.turns[-2].content for e in chosen]
    # each run is prepared first (--prepare-only) and scored at step 0, before checkpoint rotation drops it
    times["sft_s"] = lmforge(
        "sft", "--from", str(args.run), "--run-dir", str(sft_run), "--prepare-only",
        f"--posttrain.train_files={files('sft', 'train')}", f"--posttrain.val_files={files('sft', 'val')}",
        f"--train.steps={args.sft_steps}",
    )  # fmt: skip
    before, before_answers = held_out(sft_run, 0), answers(sft_run, 0, questions, args.answer_tokens)
    times["sft_s"] += lmforge("sft", "--resume", "--run-dir", str(sft_run))
    subset = sample_lines(pairs / "dpo_train.jsonl", pairs / "dpo_train_subset.jsonl", args.dpo_pairs)
    times["dpo_s"] = lmforge(
        "dpo", "--from", str(sft_run), "--run-dir", str(dpo_run), "--prepare-only",
        f'--posttrain.train_files=["{subset.resolve()}"]', f"--posttrain.val_files={files('dpo', 'val')}",
        f"--train.steps={args.dpo_steps}", *([f"--optim.lr={args.dpo_lr}"] if args.dpo_lr else []),
    )  # fmt: skip
    dpo_before = held_out(dpo_run, 0)
    times["dpo_s"] += lmforge("dpo", "--resume", "--run-dir", str(dpo_run))
    after, dpo_after = held_out(sft_run, None), held_out(dpo_run, None)
    samples = {
        "question": questions,
        "reference": [e.turns[-1].content for e in chosen],
        "before_sft": before_answers,
        "after_sft": answers(sft_run, None, questions, args.answer_tokens),
        "after_dpo": answers(dpo_run, None, questions, args.answer_tokens),
    }
    report = {
        "pairs": stats,
        "sft_heldout_loss_before": before["val_loss"],
        "sft_heldout_loss_after": after["val_loss"],
        "dpo_heldout_before": dpo_before,
        "dpo_heldout_after": dpo_after,
        "times_s": times,
        "threads": torch.get_num_threads(),
        "samples": samples,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"SFT held-out response loss: {before['val_loss']:.4f} before -> {after['val_loss']:.4f} after")
    acc, margin = dpo_after["val_rewards/accuracies"], dpo_after["val_rewards/margins"]
    print(f"DPO held-out reward accuracy {acc:.3f}, margin {margin:.3f} (loss {dpo_after['val_loss']:.4f})")
    print("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    for i, q in enumerate(questions):
        print(f"\nQ: {q}\n  reference: {samples['reference'][i]}")
        for key in ("before_sft", "after_sft", "after_dpo"):
            print(f"  {key}: {samples[key][i]}")


if __name__ == "__main__":
    main()
