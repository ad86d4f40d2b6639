"""``lmforge train``: a recipe (and ``--SECTION.KEY=VALUE`` flags) -> a run folder (``train/launch.py``)."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from lmforge.cli.common import say
from lmforge.progress import Progress
from lmforge.recipe import parse_overrides, reference_text

SIGNALS = {s.name for s in signal.Signals}


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a recipe",
        description="Train (or resume) a model. Any config key can be overridden as --SECTION.KEY=VALUE.",
        epilog="config keys (defaults shown):\n" + reference_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML recipe (default: the built-in defaults)")
    p.add_argument("--run-dir", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(func=cmd_train, overrides=True)


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    # PyTorch and its companions take seconds to import on a busy machine (25 s measured on 2 shared
    # cores): shown only once it lasts, on stdout, so that a bad recipe's error stays one line on stderr
    shown = Progress("lmforge train: loading PyTorch", opening="", tty=False, emit=say)
    with shown, shown.ticking():
        from lmforge.train.launch import run_folder, train

    cfg, run_dir, resume = run_folder(args.config, args.run_dir, args.resume, parse_overrides(extra))
    say(f"run folder: {run_dir}")
    return finish(train(cfg, run_dir, resume=resume), run_dir, "train")


def finish(summary: dict, run_dir: Path, command: str) -> int:
    """Print how a run ended; the exit status (128 + signal number for a run stopped by a signal)."""
    if summary.get("stopped"):
        say(
            f"stopped at step {summary['step']} ({summary['reason'] or 'requested'}); "
            f"checkpoint: {summary['checkpoint']}\n"
            f"continue with: lmforge {command} --resume --run-dir {run_dir}"
        )
        return 128 + signal.Signals[summary["reason"]].value if summary["reason"] in SIGNALS else 0
    sample = summary.pop("sample", None)
    if "unigram_loss" in summary:
        losses = (
            f"val_loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f}), unigram_loss "
            f"{summary['unigram_loss']:.4f}, ratio {summary['val_loss_over_unigram']:.3f}"
        )
    elif "val_loss" in summary:  # post-training: the held-out records
        extra = {
            k: v for k, v in summary.items() if k.startswith("val_") and k not in ("val_loss", "val_ppl")
        }
        losses = f"held-out loss {summary['val_loss']:.4f}" + "".join(
            f", {k} {v:.4f}" for k, v in extra.items()
        )
    else:
        losses = "no held-out records"
    say(
        f"done: step {summary['step']}, {losses}, {summary['tokens_seen']:,} tokens in "
        f"{summary['wall_time_s']:.0f}s"
    )
    if sample is not None:
        say("sample:\n" + sample)
    return 0
