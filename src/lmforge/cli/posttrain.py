"""``lmforge sft`` / ``dpo`` / ``reward`` / ``rl``: post-training runs started from another run's checkpoint
(``posttrain/finetune.py``), trained as ``lmforge train`` trains."""

from __future__ import annotations

import argparse

from lmforge.cli.common import say
from lmforge.cli.train import finish
from lmforge.recipe import parse_overrides


def add_commands(sub: argparse._SubParsersAction) -> None:
    from lmforge.config import POSTTRAIN_DEFAULTS

    helps = {
        "sft": "supervised fine-tuning on instruction / chat / prompt-completion records",
        "dpo": "direct preference optimisation on prompt / chosen / rejected pairs",
        "rl": "RL from rewards (GRPO, RLOO, PPO) on prompt records, scored by [rl] reward (a Python function or a reward run)",
        "reward": "a reward model (scalar head, Bradley-Terry loss) on prompt / chosen / rejected pairs",
    }
    for kind, text in helps.items():
        p = sub.add_parser(
            kind,
            help=text + " (docs/post-training.md)",
            description=f"{text}, from another run's checkpoint (--from) or resumed (--resume). Keys as for "
            "train: the recipe, then --SECTION.KEY=VALUE ([posttrain] records, [dpo] loss, [reward] margin, [rl], train, optim, ...).",
            epilog=f"{kind}'s own defaults (under the recipe and flags): "
            + ", ".join(f"{k}={v}" for k, v in POSTTRAIN_DEFAULTS[kind].items())
            + "; model.* and data.seq_len come from --from",
        )
        p.add_argument("recipe", nargs="?", metavar="RECIPE", help="TOML recipe (optional)")
        p.add_argument("--from", dest="from_run", metavar="RUN", help="run folder to start from")
        p.add_argument("--step", type=int, help="checkpoint step of --from (default: the newest)")
        p.add_argument("--run-dir", help=f"the new run folder (default: runs/{kind}-<timestamp>)")
        p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
        p.add_argument(
            "--prepare-only",
            action="store_true",
            help="write the run folder and its step-0 checkpoint, no steps",
        )
        p.set_defaults(func=cmd_posttrain, overrides=True)


def cmd_posttrain(args: argparse.Namespace, extra: list[str]) -> int:
    """``lmforge sft`` / ``dpo`` / ``reward``: start a post-training run from --from RUN, or --resume one."""
    from lmforge.posttrain.finetune import open_run
    from lmforge.train.launch import train

    kind = args.command
    cfg, run_dir, started = open_run(
        kind, args.from_run, args.run_dir, args.recipe, parse_overrides(extra), args.step, args.resume
    )
    if started is not None:
        say(f"run folder: {run_dir} (started from {args.from_run}: {started.name})")
        if args.prepare_only:
            say(f"prepared; train with: lmforge {kind} --resume --run-dir {run_dir}")
            return 0
    return finish(train(cfg, run_dir, resume=True), run_dir, kind)
