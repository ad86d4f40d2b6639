"""``lmforge data train-classifier``: a quality model from files of positive and negative examples.

Each ``--positive`` / ``--negative`` entry is a file, folder or glob of ``.txt`` (one document a file),
``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (text under ``--text-field``) or ``.parquet`` files, read by
:mod:`lmforge.corpus.readers`, or the built-in corpus ``builtin:pystdlib`` (both domains),
``builtin:pystdlib:prose`` or ``builtin:pystdlib:code``. Bad records (malformed JSON, empty text) are
counted and skipped. With ``--max-docs N`` each class keeps a seeded uniform sample of N documents
(reservoir sampling: memory holds N documents, not the files). Everything is checked before anything is
written; then ``OUT`` (the model, :mod:`lmforge.corpus.quality_model`) and ``OUT``'s report
(``<OUT without suffix>.report.json``) are written.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.corpus import readers
from lmforge.corpus.quality_model import FeatureSpec, train_quality_model
from lmforge.errors import DataError, UserError

FORMATS = ("txt", "jsonl", "parquet")


def report_path(out: str | Path) -> Path:
    """Where the report of the model at ``out`` goes: ``quality.npz`` -> ``quality.report.json``."""
    return Path(out).with_suffix(".report.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--positive", nargs="+", required=True, metavar="FILES", help="files, folders or globs of "
                   "the class to keep (txt/jsonl/parquet), or builtin:pystdlib[:prose|:code]")  # fmt: skip
    p.add_argument("--negative", nargs="+", required=True, metavar="FILES", help="the class to remove")
    p.add_argument("--out", required=True, metavar="MODEL", help="model file to write (e.g. quality.npz)")
    p.add_argument(
        "--text-field", default="text", help="JSONL key / parquet column of the text (default text)"
    )
    p.add_argument(
        "--max-docs", type=int, default=None, help="a seeded sample of at most N documents per class"
    )
    p.add_argument(
        "--held-out", type=float, default=0.2, help="share held out for accuracy/AUC (default 0.2)"
    )
    p.add_argument(
        "--c", type=float, default=1.0, help="inverse L2 strength of the logistic regression (1.0)"
    )
    p.add_argument("--seed", type=int, default=0, help="sample, held-out split and solver (default 0)")


def _builtin(entry: str, field: str) -> Iterator[str] | None:
    """Texts of ``builtin:pystdlib[:DOMAIN]``, None for a file path."""
    if not entry.startswith("builtin:"):
        return None
    name, _, domain = entry.removeprefix("builtin:").partition(":")
    readers.builtin_corpus(f"builtin:{name}", field)
    from lmforge.corpus.pystdlib import DOMAINS, read_pystdlib

    if domain and domain not in DOMAINS:
        raise DataError(
            f"{field}: unknown domain {domain!r} of builtin:{name}; give one of {', '.join(DOMAINS)}"
        )
    return (d.text for d in read_pystdlib() if not domain or d.domain == domain)


def _files(entries: list[str], field: str, text_field: str) -> list[tuple[str, list[Path]]]:
    """Each entry with its files (empty for a built-in corpus); DataError names ``field`` and the entry."""
    out: list[tuple[str, list[Path]]] = []
    for entry in entries:
        if entry.startswith("builtin:"):
            _builtin(entry, field)  # checks the name
            out.append((entry, []))
            continue
        files = readers.expand_paths(entry, field, FORMATS)
        for path in files:
            fmt = readers.detect_format(path, FORMATS)
            if not fmt:
                raise DataError(f"{field}: {path} is not txt, jsonl or parquet; give files of those formats")
            if fmt == "parquet":
                readers.check_parquet_column(path, text_field, "--text-field")
        out.append((entry, files))
    return out


def _texts(
    listing: list[tuple[str, list[Path]]], field: str, text_field: str, counts: dict[str, int]
) -> Iterator[str]:
    opts = readers.ReadOptions(text_field=text_field, strict_utf8=False)
    for entry, files in listing:
        builtin = _builtin(entry, field)
        if builtin is not None:
            yield from builtin
            continue
        for path in files:
            counts["files"] += 1
            fmt = readers.detect_format(path, FORMATS)
            for out in readers.read_piece(readers.whole_file(path, fmt), opts):
                if isinstance(out, tuple):
                    counts["bad_records"] += 1
                else:
                    yield out.text


def sample(texts: Iterator[str], k: int | None, rng: random.Random, max_chars: int) -> tuple[list[str], int]:
    """A uniform sample of ``k`` texts (all if ``k`` is None) cut to ``max_chars``, and how many were seen.

    Reservoir sampling (Vitter's algorithm R): the i-th text (from 0) replaces a random slot with
    probability ``k / (i + 1)``, so every text is kept with probability ``k / n``.
    """
    kept: list[str] = []
    n = 0
    for n, text in enumerate(texts, 1):
        text = text[:max_chars]
        if k is None or len(kept) < k:
            kept.append(text)
        else:
            j = rng.randrange(n)
            if j < k:
                kept[j] = text
    return kept, n


def train_classifier(
    positive: list[str],
    negative: list[str],
    out: str | Path,
    *,
    text_field: str = "text",
    max_docs: int | None = None,
    held_out: float = 0.2,
    c: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Read both classes, train, write ``out`` and its report; returns the report."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out: {out} is a folder; give a file name such as {out / 'quality.npz'}")
    if max_docs is not None and max_docs < 2:
        raise UserError(f"--max-docs: {max_docs}; give at least 2 (documents per class)")
    if not 0.0 < held_out < 1.0:
        raise UserError(f"--held-out: {held_out}; give a share in (0, 1)")
    if c <= 0:
        raise UserError(f"--c: {c}; give a positive number")
    pos_files = _files(positive, "--positive", text_field)
    neg_files = _files(negative, "--negative", text_field)
    both = {p for _, fs in pos_files for p in fs} & {p for _, fs in neg_files for p in fs}
    if both:
        raise UserError(f"--positive and --negative both name {sorted(both)[0]}; a file belongs to one class")
    spec = FeatureSpec()
    rng = random.Random(seed)
    classes: dict[str, Any] = {}
    texts: dict[str, list[str]] = {}
    for name, listing in (("positive", pos_files), ("negative", neg_files)):
        counts = {"files": 0, "bad_records": 0}
        kept, seen = sample(_texts(listing, f"--{name}", text_field, counts), max_docs, rng, spec.max_chars)
        if not kept:
            raise DataError(
                f"--{name}: {' '.join(e for e, _ in listing)} holds no documents; give files with text"
            )
        texts[name] = kept
        classes[name] = {
            "sources": [e for e, _ in listing],
            **counts,
            "documents": seen,
            "sampled": len(kept),
        }
    model, report = train_quality_model(
        texts["positive"], texts["negative"], spec=spec, c=c, held_out=held_out, seed=seed,
        labels={"positive": " ".join(positive), "negative": " ".join(negative)},
    )  # fmt: skip
    report = {"model": str(out), "classes": classes, **report}
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    report_path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def summary(report: dict[str, Any]) -> list[str]:
    """What the command prints: documents per class, held-out figures, files written."""
    lines = []
    for name, cls in report["classes"].items():
        files = f" from {cls['files']:,} files" if cls["files"] else ""
        bad = f", {cls['bad_records']:,} bad records skipped" if cls["bad_records"] else ""
        lines.append(f"{name}: {cls['sampled']:,} of {cls['documents']:,} documents{files}{bad}")
    ho = report["held_out"]
    if ho is None:
        lines.append("held out: none (a class has fewer than 5 documents)")
    else:
        lines.append(
            f"held out ({ho['n_test']:,} documents, {ho['n_test_positive']:,} positive): "
            f"accuracy {ho['accuracy']:.4f}, AUC {ho['auc']:.4f}"
        )
    lines.append(f"trained in {report['train_seconds']:.1f} s; wrote {report['model']} and "
                 f"{report_path(report['model'])}")  # fmt: skip
    return lines
