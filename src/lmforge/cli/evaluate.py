"""``lmforge eval`` and ``lmforge generate``: a run's checkpoint scored (``evaluate/run_loading.py``,
``evaluate/files.py``) or sampled (``evaluate/generation.py``)."""

from __future__ import annotations

import argparse
import json

from lmforge.cli.common import device
from lmforge.errors import UserError


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="validation loss and perplexity of a run's newest checkpoint")
    p.add_argument("run", help="run folder")
    p.add_argument(
        "--tokens", type=int, default=0, help="validation tokens to score (default: train.eval_tokens)"
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="score these .txt / .jsonl / .parquet files instead of the validation split",
    )
    p.add_argument("--text-field", default="text", help="with --data: JSON key / parquet column of the text")
    p.add_argument(
        "--tasks",
        metavar="NAME[,NAME...]",
        help="downstream tasks: shipped names (stdlib_docstring, stdlib_next_line, stdlib_assign) or paths "
        "to task specs (.toml) / lm-evaluation-harness task files (.yaml); docs/evaluation.md",
    )
    p.add_argument(
        "--limit", type=int, default=0, help="with --tasks: the first N questions of each (0: all)"
    )
    p.add_argument("--batch-size", type=int, default=16, help="with --tasks: rows per forward pass")
    p.add_argument("--step", type=int, help="with --tasks: score checkpoint STEP (default: the newest)")
    p.add_argument(
        "--json", action="store_true", help="with --data / --tasks: one JSON object instead of the table"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run", help="run folder")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass; 1 disables")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_generate)


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.evaluate.run_loading import evaluate_run

    if args.tokens < 0:
        raise UserError(
            f"--tokens: {args.tokens} is out of range; give an integer >= 0 (0: train.eval_tokens)"
        )
    if args.data and args.tasks:
        raise UserError("--data and --tasks: give one of them (a loss task scores a file among tasks)")
    if args.data:
        return _eval_data(args)
    if args.tasks is not None:
        return _eval_tasks(args)
    print(json.dumps(evaluate_run(args.run, device(args.device), args.tokens)))
    return 0


def _eval_data(args: argparse.Namespace) -> int:
    from lmforge.evaluate.files import evaluate_files

    result = evaluate_files(args.run, args.data, device(args.device), args.text_field)
    if args.json:
        print(json.dumps(result))
        return 0
    rows = [[r["file"], f"{r['targets']:,}", f"{r['loss']:.4f}", f"{r['ppl']:.2f}"] for r in result["files"]]
    rows.append(["overall", f"{result['targets']:,}", f"{result['loss']:.4f}", f"{result['ppl']:.2f}"])
    widths = [max(len(x) for x in col) for col in zip(["file", "targets", "loss", "ppl"], *rows, strict=True)]
    print(f"{args.run} at step {result['step']}: mean next-token cross-entropy (nats) and perplexity")
    for row in [["file", "targets", "loss", "ppl"], *rows]:
        print(
            "  ".join(
                [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
            )
        )
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    from lmforge.evaluate.tasks import run_tasks

    result = run_tasks(args.run, args.tasks, device(args.device), args.batch_size, args.limit, args.step)
    if args.json:
        print(json.dumps(result))
        return 0
    rows = []
    for name, r in result["tasks"].items():
        metrics = ["acc", "acc_norm"] if r["kind"] == "multiple_choice" else [r["metric"]]
        for m in metrics:
            se = r.get(f"{m}_stderr")
            rows.append([name, m, f"{r[m]:.4f}", "-" if se is None else f"{se:.4f}", f"{r['n']:,}"])
    head = ["task", "metric", "value", "stderr", "n"]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    print(f"{args.run} at step {result['step']} (written to {result['file']})")
    for row in [head, *rows]:
        print("  ".join([*(c.ljust(w) for c, w in zip(row[:2], widths, strict=False)),
                         *(c.rjust(w) for c, w in zip(row[2:], widths[2:], strict=True))]))  # fmt: skip
    return 0


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.evaluate.generation import samples

    texts = samples(
        args.run, args.prompt, device(args.device), args.max_new_tokens, args.temperature, args.top_k,
        args.top_p, args.num_samples, args.seed,
    )  # fmt: skip
    for i, text in enumerate(texts):
        print(text)
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0
