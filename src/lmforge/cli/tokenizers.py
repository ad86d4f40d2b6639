"""``lmforge tokenizers compare``: tokenizer kinds and sizes trained and measured on the same documents
(``data/tokenizer_compare.py``), with ``--train-steps`` a small model trained on each
(``probes/tokenizer_bpb.py``)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lmforge.cli.common import say
from lmforge.errors import UserError

log = logging.getLogger("lmforge")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """``tokenizers compare``: BPE, Unigram and WordPiece trained and measured on the same documents."""
    p = sub.add_parser("tokenizers", help="compare tokenizer kinds and vocabulary sizes (docs/tokenizers.md)")
    tsub = p.add_subparsers(dest="tokenizers_command", required=True)
    p = tsub.add_parser(
        "compare",
        help="train byte-level BPE, Unigram and WordPiece on the same documents and measure them",
        description="Per domain on held-out documents: fertility, bytes per token, vocabulary used, unknown "
        "or byte-fallback rate, round-trip share, training time; with --train-steps the same small model "
        "trained on each tokenizer and its held-out bits per byte. Writes OUT/compare.json and compare.png.",
    )
    p.add_argument(
        "--sources",
        nargs="+",
        default=["builtin:pystdlib"],
        help="txt/jsonl/parquet files, folders, globs, DOMAIN=PATH, or builtin:pystdlib (default)",
    )
    p.add_argument("--vocab-sizes", default="4096,16384", help="comma-separated sizes (default 4096,16384)")
    p.add_argument("--kinds", default="bpe,unigram,wordpiece", help="comma-separated: bpe,unigram,wordpiece")
    p.add_argument("--train-steps", type=int, default=0, help="train the small model N steps per tokenizer")
    p.add_argument("--out", default="tokenizers-compare", help="output folder (default: tokenizers-compare)")
    p.add_argument("--max-docs", type=int, default=None, help="use a seeded sample of this many documents")
    p.add_argument("--seed", type=int, default=0, help="held-out split, sample and model seed (default 0)")
    p.set_defaults(func=cmd_tokenizers_compare)


def cmd_tokenizers_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.data.tokenizer_compare import CompareSettings, format_table
    from lmforge.probes.tokenizer_bpb import run_compare

    try:
        sizes = [int(v) for v in args.vocab_sizes.split(",") if v.strip()]
    except ValueError:
        raise UserError(
            f"--vocab-sizes: {args.vocab_sizes!r} is not a list of integers; e.g. 4096,16384"
        ) from None
    settings = CompareSettings(
        sources=args.sources,
        vocab_sizes=sizes,
        kinds=[k.strip() for k in args.kinds.split(",") if k.strip()],
        train_steps=args.train_steps,
        out=Path(args.out),
        max_docs=args.max_docs,
        seed=args.seed,
    )
    result = run_compare(settings, log.info)
    say(format_table(result))
    say(f"wrote {settings.out / 'compare.json'} and {settings.out / 'compare.png'}")
    return 0
