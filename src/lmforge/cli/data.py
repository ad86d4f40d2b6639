"""``lmforge data``: raw files -> kept documents -> token shards (``data/tokenize_output.py``); and its
sub-commands ``inspect``, ``stdlib-pairs``, ``sweep`` and ``train-classifier``, each parsed on its own
(``lmforge data`` takes free ``--KEY VALUE`` overrides, which a sub-command under it would mistake for its
name): :data:`SUBCOMMANDS`."""

from __future__ import annotations

import argparse
import json
import time

from lmforge.errors import UserError
from lmforge.recipe import parse_overrides


def add_commands(sub: argparse._SubParsersAction) -> None:
    """``lmforge data``; its sub-commands are in :data:`SUBCOMMANDS`."""
    p = sub.add_parser(
        "data",
        help="clean, filter and deduplicate raw files, then tokenize them",
        description="Run the pipeline of a recipe (configs/data/) into OUT: kept/ and removed/ documents, "
        "report.json and token shards (tokens/). A run started again continues where it stopped. "
        "Keys can be overridden as --SECTION.KEY=VALUE (e.g. --output.compression=none).",
        epilog="lmforge data inspect OUT --reason RULE [--n 5]: samples of what a rule removed "
        "(lmforge data inspect --help); lmforge data stdlib-pairs --out DIR: the post-training demonstration's "
        "records (lmforge data stdlib-pairs --help); lmforge data sweep --config RECIPE --out OUT: the "
        "cleaning trade-off from lenient to strict (lmforge data sweep --help); lmforge data train-classifier "
        "--positive FILES --negative FILES --out MODEL: the classifier stage's model "
        "(lmforge data train-classifier --help)",
    )
    p.add_argument("--config", required=True, help="pipeline recipe (TOML), e.g. configs/data/web.toml")
    p.add_argument("--out", required=True, help="output folder (new, or the one of a run to continue)")
    p.add_argument("--workers", type=int, default=None, help="parallel workers (default: every core)")
    p.add_argument("--executor", choices=["local", "ray"], default=None, help="default: execution.executor")
    p.add_argument("--no-tokenize", action="store_true", help="stop after the documents (no token shards)")
    p.set_defaults(func=cmd_data, overrides=True)


def cmd_data(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.config import load_pipeline_config
    from lmforge.data.tokenize_output import clean_and_tokenize

    cfg = load_pipeline_config(args.config, parse_overrides(extra))
    start = time.perf_counter()
    report = clean_and_tokenize(cfg, args.out, args.executor, args.workers, tokenize=not args.no_tokenize)
    _print_data_summary(report, args.out, time.perf_counter() - start)
    return 0


def _print_data_summary(report: dict, out: str, elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    def size(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    table = Table(title=f"lmforge data -> {out}", title_justify="left")
    for col in ("stage", "docs in", "docs out", "removed", "bytes in", "bytes out", "top reasons"):
        table.add_column(col, justify="left" if col in ("stage", "top reasons") else "right")
    for row in report["stages"]:
        reasons = sorted(row["removed"].items(), key=lambda kv: -kv[1])[:3]
        name = row["stage"] + (f" [{','.join(row['domains'])}]" if "domains" in row else "")
        table.add_row(
            name,
            f"{row['docs_in']:,}",
            f"{row['docs_out']:,}",
            f"{row['docs_in'] - row['docs_out']:,}",
            size(row["bytes_in"]),
            size(row["bytes_out"]),
            ", ".join(f"{r.split('.', 1)[1]} {c:,}" for r, c in reasons),
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    docs = report["documents"]
    console.print(
        f"{docs['input']:,} documents in, {docs['kept']:,} kept, {docs['removed']:,} removed "
        f"({report['bad_input']['count']:,} bad input records) in {elapsed:.1f}s; "
        f"kept by domain: {', '.join(f'{d} {n:,}' for d, n in report['kept_by_domain'].items()) or 'none'}"
    )
    if "tokens" in report:
        tokens = report["tokens"]["tokens"]
        console.print(
            f"tokens ({report['tokens']['vocab_size']:,}-entry BPE): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(tokens.items()))
            + f'; train on them with data.prepared = "{out}"'
        )


def build_inspect_parser() -> argparse.ArgumentParser:
    """``lmforge data inspect``: parsed on its own (``lmforge data`` takes free ``--KEY VALUE`` overrides,
    which a sub-command under it would mistake for its name)."""
    p = argparse.ArgumentParser(
        prog="lmforge data inspect",
        description="Show what a rule removed in a finished `lmforge data` run: how many documents, and the "
        "first N with the value the rule measured, its threshold and (with output.removed_text = true) "
        "the start of the text.",
    )
    p.add_argument("out", metavar="OUT", help="the --out folder of a finished lmforge data run")
    p.add_argument(
        "--reason",
        required=True,
        metavar="RULE",
        help="a removal reason (c4.too_few_sentences) or a prefix of reasons (c4: every c4.* rule)",
    )
    p.add_argument("--n", type=int, default=5, help="how many removed documents to show (default 5)")
    p.add_argument("--chars", type=int, default=600, help="characters of each text to show (default 600)")
    p.set_defaults(func=cmd_data_inspect, command="data inspect")
    return p


def cmd_data_inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.removals import excerpt, sample_removals

    if args.chars < 1:
        raise UserError(
            f"--chars: give how many characters of each text to show, at least 1 (got {args.chars})"
        )
    found = sample_removals(args.out, args.reason, args.n)
    by_reason = ", ".join(f"{r} {c:,}" for r, c in found.counts.items())
    shown = f"the first {len(found.samples)}" if len(found.samples) < found.total else "all"
    print(f"{found.rule}: {found.total:,} documents removed in {args.out} ({by_reason}); {shown}:")
    for i, rec in enumerate(found.samples, 1):
        source = rec["source"]
        where = found.sources[source] if 0 <= source < len(found.sources) else "?"
        print(f"\n[{i}] {rec['id']}  (source {source}: {where}; domain {rec['domain']})")
        print(f"    {rec['reason']}: {_measure(rec)}")
        if found.text_kept:
            text, rest = excerpt(rec.get("text", ""), args.chars, 12)
            print("\n".join(f"    | {line}" for line in text.split("\n")) if text else "    | (empty text)")
            if rest:
                print(f"    | ... {rest:,} more characters")
    if not found.text_kept:
        print(
            "\n(the run kept no removed text: run it with --output.removed_text=true into a new --out "
            "to see the documents here)"
        )
    return 0


def _measure(rec: dict) -> str:
    """A removal record's measure in words: value against threshold, the kept copy, the input line."""
    parts = []
    if rec.get("value") is not None:
        parts.append(f"value {_shown(rec['value'])}")
    if rec.get("threshold") is not None:
        parts.append(f"threshold {_shown(rec['threshold'])}")
    if rec.get("duplicate_of") is not None:
        parts.append(f"duplicate of {rec['duplicate_of']}")
    if rec.get("file") is not None:
        parts.append(f"at {rec['file']}:{rec.get('line')}")
    return ", ".join(parts) or "no value or threshold"


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def build_stdlib_pairs_parser() -> argparse.ArgumentParser:
    """``lmforge data stdlib-pairs``: parsed on its own, as ``data inspect``."""
    from lmforge.posttrain.stdlib_pairs import DEFAULT_MAX_LEN_CHARS, DEFAULT_VAL_FRACTION

    p = argparse.ArgumentParser(
        prog="lmforge data stdlib-pairs",
        description="The post-training demonstration's records: questions about the standard library's "
        "modules, classes, functions and methods answered by their docstrings (SFT and DPO JSONL, whole "
        "modules held out for validation, stats.json).",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--max-len-chars",
        type=int,
        default=DEFAULT_MAX_LEN_CHARS,
        help=f"skip objects whose question + answer is longer (default {DEFAULT_MAX_LEN_CHARS})",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"share of modules held out, by seeded hash of the name (default {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument("--seed", type=int, default=0, help="split, phrasing and rejected answers (default 0)")
    p.set_defaults(func=cmd_data_stdlib_pairs, command="data stdlib-pairs")
    return p


def cmd_data_stdlib_pairs(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.posttrain.stdlib_pairs import stdlib_pairs

    stats = stdlib_pairs(args.out, args.seed, args.val_fraction, args.max_len_chars)
    splits, objects = stats["splits"], stats["objects"]
    print(
        f"{objects['found']:,} objects in {stats['files']:,} files: {objects['kept']:,} kept, skipped "
        + ", ".join(f"{r} {n:,}" for r, n in objects["skipped"].items())
    )
    for name, split in splits.items():
        kinds = ", ".join(f"{k} {n:,}" for k, n in split["by_kind"].items())
        print(
            f"{name}: {split['sft']:,} SFT records and DPO pairs from {split['modules']:,} modules ({kinds})"
        )
    print(f"wrote sft_*.jsonl, dpo_*.jsonl and stats.json to {args.out}")
    return 0


def build_sweep_parser() -> argparse.ArgumentParser:
    """``lmforge data sweep``: parsed on its own, as ``data inspect``."""
    p = argparse.ArgumentParser(
        prog="lmforge data sweep",
        description="The cleaning trade-off: run a recipe's filtering stages from lenient (level 0: no "
        "filtering) to strict (100: the strictest documented thresholds) and measure, per level, the size "
        "kept, the mean quality score under a fixed reference and the diversity of the kept text. Writes "
        "OUT/level-*/ (each a lmforge data run), OUT/sweep.json and OUT/sweep.png (docs/data.md).",
    )
    p.add_argument("--config", required=True, help="pipeline recipe (TOML), e.g. configs/data/web-model.toml")
    p.add_argument("--out", required=True, help="output folder (new, or a sweep to continue)")
    p.add_argument(
        "--levels", default="0,20,40,60,80,100", help="strictness levels 0..100 (default 0,20,...,100)"
    )
    p.add_argument("--reference-classifier", metavar="MODEL", help="score quality with this classifier model")
    p.add_argument(
        "--reference-run", metavar="RUN", help="score quality by perplexity under this run's model"
    )
    p.add_argument(
        "--reference-tokens",
        type=int,
        default=512,
        help="--reference-run scores each document's first N tokens (default 512)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json counting tokens (default: see docs/data.md)")
    p.add_argument(
        "--ngram", type=int, default=2, help="word n-gram size of the diversity measure (default 2)"
    )
    p.add_argument("--workers", type=int, default=None, help="parallel workers (default: every core)")
    p.add_argument("--seed", type=int, default=0, help="order of the fixed-size diversity sample (default 0)")
    p.set_defaults(func=cmd_data_sweep, command="data sweep")
    return p


def cmd_data_sweep(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.config import load_pipeline_config
    from lmforge.corpus.sweep import parse_levels, pick_reference, run_sweep, sweep_table

    cfg = load_pipeline_config(args.config)
    levels = parse_levels(args.levels)
    ref = pick_reference(cfg, args.reference_classifier, args.reference_run)
    result = run_sweep(
        cfg, args.out, levels, ref, args.tokenizer, args.ngram, args.workers,
        seed=args.seed, reference_tokens=args.reference_tokens,
    )  # fmt: skip
    print(sweep_table(result))
    print(f"wrote {args.out}/sweep.json and {args.out}/sweep.png")
    return 0


def build_train_classifier_parser() -> argparse.ArgumentParser:
    """``lmforge data train-classifier``: parsed on its own, as ``data inspect``."""
    from lmforge.corpus.train_classifier import add_arguments

    p = argparse.ArgumentParser(
        prog="lmforge data train-classifier",
        description="Train the classifier stage's model: logistic regression on hashed word and character "
        "n-grams, P(positive) per document. Prints held-out accuracy; writes MODEL and its .report.json.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_data_train_classifier, command="data train-classifier")
    return p


def cmd_data_train_classifier(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.train_classifier import summary, train_classifier

    report = train_classifier(
        args.positive, args.negative, args.out, text_field=args.text_field, max_docs=args.max_docs,
        held_out=args.held_out, c=args.c, seed=args.seed,
    )  # fmt: skip
    print("\n".join(summary(report)))
    return 0


SUBCOMMANDS = {
    "inspect": build_inspect_parser,
    "stdlib-pairs": build_stdlib_pairs_parser,
    "sweep": build_sweep_parser,
    "train-classifier": build_train_classifier_parser,
}


def subcommand(argv: list[str]) -> str | None:
    """The sub-command of ``argv = [-v] data NAME ...`` when NAME is one of :data:`SUBCOMMANDS`, else None."""
    at = next((i for i, a in enumerate(argv) if a not in ("-v", "--verbose")), len(argv))
    if argv[at : at + 1] == ["data"] and len(argv) > at + 1 and argv[at + 1] in SUBCOMMANDS:
        return argv[at + 1]
    return None
