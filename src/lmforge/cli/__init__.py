"""The ``lmforge`` command: one module per command group, each a thin parser over a library call (parse,
call one library function, print). This module assembles the parser, sets up logging and turns a user's
error into one line and exit status 2.

Where each command's code lives: ``docs/architecture.md`` ("Where each command's code lives").
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from lmforge.cli import (
    data,
    evaluate,
    experiment,
    hf,
    plan,
    posttrain,
    probes,
    report,
    tokenizers,
    train,
    web,
)
from lmforge.cli.common import rank
from lmforge.errors import Interrupted, UserError

# in the order ``lmforge --help`` lists them
GROUPS = (train, data, posttrain, evaluate, report, experiment, web, hf, probes, plan, tokenizers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="Train language models from raw text.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def setup_logging(verbose: bool) -> None:
    """Log to stderr; under torchrun only rank 0 logs progress, the other ranks warnings and errors."""
    level = logging.DEBUG if verbose else logging.INFO
    if rank() > 0 and not verbose:
        level = logging.WARNING
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, show_time=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root = logging.getLogger("lmforge")
    root.handlers[:] = [handler]
    root.setLevel(level)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(args, overrides)``; the ``--SECTION.KEY=VALUE`` overrides only for commands that take them."""
    name = data.subcommand(argv)
    if name is not None:  # lmforge data NAME: parsed on its own
        at = argv.index("data")
        args = data.SUBCOMMANDS[name]().parse_args(argv[at + 2 :])
        args.verbose = at > 0
        return args, []
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, extra


def main(argv: list[str] | None = None) -> None:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.verbose)
    try:
        code = args.func(args, extra)
    except UserError as exc:
        if rank() == 0:  # every rank meets the same error in the same config; one line is enough
            print(f"lmforge {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Interrupted as exc:
        print(f"interrupted ({signal.Signals(exc.signal).name} twice): exited at once", file=sys.stderr)
        code = 128 + int(exc.signal)
    sys.exit(code)
