"""``lmforge tokenizers compare``: byte-level BPE, Unigram and WordPiece trained on the same documents.

Documents come from ``--sources`` (txt / jsonl / parquet files, folders, globs, ``DOMAIN=PATH`` to name a
domain, or ``builtin:pystdlib`` with its domains ``code`` and ``prose``), read with training's readers
(:mod:`lmforge.data.sources`). A document is held out when :func:`held_out` says so (a BLAKE2b hash of
``"<seed>/<id>"``, the same rule :func:`~lmforge.data.sources.is_validation` applies to the ids this module
writes, so a model trained with ``--train-steps`` validates on exactly the held-out documents). Every
tokenizer is trained on the other documents; each metric is measured per domain on the held-out ones
(:func:`measure`), and with ``train_steps`` the same small lmforge model is trained on each tokenizer and
its held-out loss converted to bits per byte (:func:`bits_per_byte`), the figure that compares across
tokenizers (loss per token does not: a token covers a different amount of text under each tokenizer).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lmforge.config import SourceConfig
from lmforge.corpus import readers
from lmforge.corpus.document import Doc
from lmforge.data.sources import FORMATS, is_validation, read_source
from lmforge.errors import UserError
from lmforge.tokenizer import Tokenizer, batched
from lmforge.tokenizer.kinds import KINDS, MIN_VOCAB, train_kind, unknown_tokens

log = logging.getLogger(__name__)

DEFAULT_SOURCES = ("builtin:pystdlib",)
DEFAULT_VOCAB_SIZES = (4096, 16384)
HELD_OUT_FRACTION = 0.1
ALL = "all"  # the row over every domain
BPB_NOTE = (
    "bits per byte = held-out token NLL (nats) / (ln 2 x UTF-8 bytes of the text): it compares across "
    "tokenizers; loss per token does not (a token covers a different amount of text under each tokenizer)"
)
WORDPIECE_BPB_NOTE = (
    "wordpiece: its tokens leave out whitespace (round-trip 0), so its model never predicts spaces, "
    "newlines or indentation that the others must; its bits per byte is not a like-for-like figure"
)


@dataclass
class CompareSettings:
    """What ``lmforge tokenizers compare`` was asked for (checked by :func:`check_settings`)."""

    sources: list[str] = field(default_factory=lambda: list(DEFAULT_SOURCES))
    vocab_sizes: list[int] = field(default_factory=lambda: list(DEFAULT_VOCAB_SIZES))
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    train_steps: int = 0
    out: Path = Path("tokenizers-compare")
    max_docs: int | None = None
    seed: int = 0
    held_out_fraction: float = HELD_OUT_FRACTION


# ---------------------------------------------------------------- formulas


def fertility(tokens: int, words: int) -> float:
    """Tokens per whitespace-separated word: ``tokens / words`` (``words = len(text.split())``)."""
    return tokens / words if words else float("nan")


def bytes_per_token(n_bytes: int, tokens: int) -> float:
    """UTF-8 bytes of the text per token: ``bytes / tokens``."""
    return n_bytes / tokens if tokens else float("nan")


def vocab_share(distinct_ids: int, vocab_size: int) -> float:
    """Share of the vocabulary used: ``distinct token ids seen / vocabulary size``."""
    return distinct_ids / vocab_size


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Bits per byte: ``bpb = nll_nats / (ln 2 * n_bytes)``.

    ``nll_nats`` is the sum of the next-token negative log-likelihoods (natural log) of every token the
    model predicted and ``n_bytes`` the UTF-8 bytes of the text those tokens encode. The tokens cancel out,
    so the figure compares models with different tokenizers (the mean loss per token does not).
    """
    return nll_nats / (math.log(2) * n_bytes)


def held_out(doc_id: str, fraction: float, seed: int) -> bool:
    """A document is held out when BLAKE2b-64 of ``"<seed>/<id>"`` / 2**64 < ``fraction``."""
    return is_validation(f"{seed}/{doc_id}", fraction)


# ---------------------------------------------------------------- input


def parse_source(entry: str) -> SourceConfig:
    """``PATH`` or ``DOMAIN=PATH`` (a domain name of letters, digits, ``_`` and ``-``) as a source."""
    name, sep, path = entry.partition("=")
    if sep and name and name.replace("_", "").replace("-", "").isalnum() and "/" not in name:
        return SourceConfig(path=path, domain=name)
    return SourceConfig(path=entry)


def check_settings(s: CompareSettings) -> None:
    """Every flag checked before any work; a UserError (one line: the flag and the fix) for a bad one."""
    if not s.sources:
        raise UserError("--sources: no source given; give files, globs or builtin:pystdlib")
    for entry in s.sources:
        src = parse_source(entry)
        if readers.builtin_corpus(src.path, "--sources") is None:
            readers.expand_paths(src.path, "--sources", FORMATS)
    if not s.kinds:
        raise UserError(f"--kinds: no kind given; choose from {','.join(KINDS)}")
    for kind in s.kinds:
        if kind not in KINDS:
            raise UserError(f"--kinds: unknown kind {kind!r}; choose from {','.join(KINDS)}")
    if not s.vocab_sizes:
        raise UserError("--vocab-sizes: no size given; e.g. --vocab-sizes 4096,16384")
    for kind in s.kinds:
        for v in s.vocab_sizes:
            if v < MIN_VOCAB[kind]:
                raise UserError(
                    f"--vocab-sizes: {v} is too small for {kind} (at least {MIN_VOCAB[kind]}); raise it"
                )
    if s.train_steps < 0:
        raise UserError(f"--train-steps: {s.train_steps} is negative; give 0 (no model) or more")
    if s.max_docs is not None and s.max_docs < 2:
        raise UserError(f"--max-docs: {s.max_docs} leaves no held-out split; give at least 2")
    if s.out.exists() and not s.out.is_dir():
        raise UserError(f"--out: {s.out} is a file; give a folder (new or one of an earlier compare)")


def load_documents(s: CompareSettings) -> tuple[list[Doc], list[Doc]]:
    """(training, held-out) documents; ``max_docs`` keeps those with the smallest seeded hash (a sample
    of every domain in proportion). UserError when either split is empty."""
    docs = (doc for entry in s.sources for doc in read_source(parse_source(entry)) if doc.text.strip())
    if s.max_docs is not None:
        docs = iter(heapq.nsmallest(s.max_docs, docs, key=lambda d: _rank(d.id, s.seed)))
    train, held = [], []
    for doc in docs:
        (held if held_out(doc.id, s.held_out_fraction, s.seed) else train).append(doc)
    if not train and not held:
        raise UserError(f"--sources: no document with text in {', '.join(s.sources)}; check the paths")
    if not train or not held:
        raise UserError(
            f"--sources: {len(train) + len(held)} documents leave an empty training or held-out split; "
            "give more documents (or a larger --max-docs)"
        )
    return train, held


def _rank(doc_id: str, seed: int) -> bytes:
    """The sampling order of ``--max-docs``: BLAKE2b-64 of ``"sample/<seed>/<id>"``."""
    return hashlib.blake2b(f"sample/{seed}/{doc_id}".encode(), digest_size=8).digest()


# ---------------------------------------------------------------- measuring


@dataclass
class Counts:
    """What :func:`measure` adds up over the documents of one domain."""

    documents: int = 0
    words: int = 0
    bytes: int = 0
    tokens: int = 0
    unknown: int = 0
    round_trips: int = 0
    ids: set[int] = field(default_factory=set)

    def add(self, other: Counts) -> None:
        self.documents += other.documents
        self.words += other.words
        self.bytes += other.bytes
        self.tokens += other.tokens
        self.unknown += other.unknown
        self.round_trips += other.round_trips
        self.ids |= other.ids

    def row(self, vocab_size: int) -> dict:
        return {
            "documents": self.documents,
            "words": self.words,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "fertility": fertility(self.tokens, self.words),
            "bytes_per_token": bytes_per_token(self.bytes, self.tokens),
            "vocab_used": vocab_share(len(self.ids), vocab_size),
            "unknown_rate": self.unknown / self.tokens if self.tokens else float("nan"),
            "round_trip": self.round_trips / self.documents if self.documents else float("nan"),
        }


def measure(tok: Tokenizer, kind: str, docs: Sequence[Doc]) -> dict[str, dict]:
    """Per domain (and ``"all"``): fertility, bytes per token, share of the vocabulary used, unknown /
    byte-fallback rate (tokens that are [UNK] / <unk> / <0x..>) and the share of documents with
    ``decode(encode(text)) == text``, with the counts behind them."""
    unk = np.array(
        [i for t in unknown_tokens(kind) if (i := tok._tok.token_to_id(t)) is not None], dtype=np.int64
    )
    per: dict[str, Counts] = {}
    for batch in batched(docs, 256):
        for doc, ids in zip(batch, tok.encode_batch([d.text for d in batch]), strict=True):
            arr = np.asarray(ids, dtype=np.int64)
            c = per.setdefault(doc.domain, Counts())
            c.documents += 1
            c.words += len(doc.text.split())
            c.bytes += len(doc.text.encode("utf-8"))
            c.tokens += len(ids)
            c.unknown += int(np.isin(arr, unk).sum()) if len(unk) else 0
            c.round_trips += tok.decode(ids) == doc.text
            c.ids.update(np.unique(arr).tolist())
    total = Counts()
    for c in per.values():
        total.add(c)
    rows = {d: per[d].row(tok.vocab_size) for d in sorted(per)}
    rows[ALL] = total.row(tok.vocab_size)
    return rows


# ---------------------------------------------------------------- the whole comparison


def docs_folder(out: Path) -> Path:
    """Every document of a domain as JSONL (``<domain>.jsonl``): the model's ``data.sources``."""
    return out / "work" / "docs"


def held_out_folder(out: Path) -> Path:
    """The held-out documents of a domain as JSONL (``<domain>.jsonl``): what bits per byte is measured on."""
    return out / "work" / "held-out"


def write_jsonl(docs: Sequence[Doc], path: Path, seed: int) -> None:
    """Documents as JSONL whose ids are ``"<seed>/<id>"`` (so training's split equals :func:`held_out`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"id": f"{seed}/{d.id}", "text": d.text}) + "\n")


# score(tokenizer.json, domains, held-out documents, settings, run folder) -> the model's figures
ModelScorer = Callable[[Path, list[str], Sequence[Doc], CompareSettings, Path], dict]


def compare(
    s: CompareSettings, score: ModelScorer | None = None, say: Callable[[str], None] = log.info
) -> dict:
    """Train each (kind, vocab size) and measure it on the held-out documents; with ``s.train_steps``,
    ``score`` trains the model on each tokenizer and measures its bits per byte (after the documents are
    written to ``OUT/work/docs/<domain>.jsonl`` and ``OUT/work/held-out/<domain>.jsonl``). Writes
    ``compare.json`` into ``s.out`` and returns the result."""
    check_settings(s)
    if s.train_steps and score is None:
        raise ValueError("train_steps needs a model scorer")
    train_docs, held = load_documents(s)
    domains = sorted({d.domain for d in train_docs} | {d.domain for d in held})
    say(
        f"documents: {len(train_docs)} training, {len(held)} held out ({', '.join(domains)}); "
        f"training bytes {sum(len(d.text.encode()) for d in train_docs):,}"
    )
    s.out.mkdir(parents=True, exist_ok=True)
    if s.train_steps:
        docs_dir = docs_folder(s.out)
        for d in domains:  # every document of the domain; training's split holds out the same ones
            write_jsonl([x for x in [*train_docs, *held] if x.domain == d], docs_dir / f"{d}.jsonl", s.seed)
            write_jsonl([x for x in held if x.domain == d], held_out_folder(s.out) / f"{d}.jsonl", s.seed)
    results = []
    for v in s.vocab_sizes:
        for kind in s.kinds:
            path = s.out / "tokenizers" / f"{kind}-{v}" / "tokenizer.json"
            t0 = time.perf_counter()
            tok = train_kind(kind, (d.text for d in train_docs), v, path)
            seconds = time.perf_counter() - t0
            row = {
                "kind": kind,
                "vocab_size": v,
                "actual_vocab_size": tok.vocab_size,
                "path": str(path),
                "train_seconds": seconds,
                "domains": measure(tok, kind, held),
            }
            say(
                f"{kind}-{v}: trained in {seconds:.1f}s, fertility {row['domains'][ALL]['fertility']:.3f}, "
                f"bytes/token {row['domains'][ALL]['bytes_per_token']:.3f}"
            )
            if s.train_steps and score is not None:
                row["model"] = score(path, domains, held, s, s.out / "runs" / f"{kind}-{v}")
                say(f"{kind}-{v}: held-out bits per byte {row['model']['domains'][ALL]['bpb']:.4f}")
            results.append(row)
    result = {
        "sources": s.sources,
        "seed": s.seed,
        "held_out_fraction": s.held_out_fraction,
        "max_docs": s.max_docs,
        "documents": {
            "train": len(train_docs),
            "held_out": len(held),
            "train_bytes": sum(len(d.text.encode("utf-8")) for d in train_docs),
        },
        "domains": [*domains, ALL],
        "notes": {
            "unknown_rate": "share of held-out tokens that are [UNK] (wordpiece), <unk> or a byte-fallback "
            "<0x..> piece (unigram); byte-level BPE has 256 byte symbols, so 0 by construction",
            "round_trip": "share of held-out documents with decode(encode(text)) == text; WordPiece drops "
            "whitespace and splits punctuation, so it does not round-trip",
            "bpb": BPB_NOTE,
        },
        "results": results,
    }
    if s.train_steps and results:
        result["model"] = results[0]["model"]["config"]
    (s.out / "compare.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    """The comparison as a plain-text table: one line per (kind, vocab size, domain)."""
    model = any("model" in r for r in result["results"])
    head = (
        f"{'kind':<10s} {'vocab':>6s} {'domain':<8s} {'fertility':>9s} {'bytes/tok':>9s} {'vocab used':>10s} "
        f"{'unk rate':>9s} {'round-trip':>10s} {'train s':>8s}"
    )
    if model:
        head += f" {'loss/tok':>8s} {'bpb':>7s}"
    lines = [head, "-" * len(head)]
    for r in result["results"]:
        for d in result["domains"]:
            m = r["domains"].get(d)
            if m is None:
                continue
            line = (
                f"{r['kind']:<10s} {r['vocab_size']:>6d} {d:<8s} {m['fertility']:9.3f} {m['bytes_per_token']:9.3f} "
                f"{m['vocab_used']:10.3f} {m['unknown_rate']:9.5f} {m['round_trip']:10.3f} {r['train_seconds']:8.1f}"
            )
            if model and d in r.get("model", {}).get("domains", {}):
                b = r["model"]["domains"][d]
                line += f" {b['loss_per_token']:8.4f} {b['bpb']:7.4f}"
            lines.append(line)
    lines.append("unk rate: " + result["notes"]["unknown_rate"])
    lines.append("round-trip: " + result["notes"]["round_trip"])
    if model:
        lines.append(BPB_NOTE)
        if any(r["kind"] == "wordpiece" for r in result["results"]):
            lines.append(WORDPIECE_BPB_NOTE)
    return "\n".join(lines)
