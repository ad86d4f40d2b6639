"""``lmforge eval RUN --data FILES``: the loss of a run's newest checkpoint on text files of the user's.

Each file is read with training's readers (``data/sources.py``: txt = one document, JSONL = one document
per line under ``text_field``, parquet = a text column) and tokenised with the run's tokenizer exactly as
``data/prepare.py`` stores documents: ``<|endoftext|>`` then the document's tokens, documents back to
back. A file's stream of ``N`` tokens is scored like the validation split (``data/loader.py``): windows
of ``seq_len + 1`` tokens at stride ``seq_len`` (the first ``(N - 1) // seq_len`` windows, the same
batches as :func:`~lmforge.evaluate.validation.evaluate`), then the remaining ``r = (N - 1) mod seq_len``
targets as one shorter window, so every token but the first is a target once. Loss per file and overall
is the mean next-token cross-entropy over those targets (nats), in the run's precision.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lmforge.config import SourceConfig
from lmforge.corpus import readers
from lmforge.data.loader import Batch, TokenStream, eval_batches, stack
from lmforge.data.shards import Shard
from lmforge.data.sources import FORMATS, read_source
from lmforge.errors import UserError
from lmforge.evaluate.run_loading import load_run
from lmforge.evaluate.validation import loss_sum, perplexity
from lmforge.model.loss import NextTokenLoss
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import Tokenizer


@dataclass
class FileTokens:
    """One file as a token stream: ``tokens`` (documents, each led by end-of-text) and document starts."""

    path: Path
    documents: int
    tokens: np.ndarray  # int64
    offsets: np.ndarray  # int64, documents + 1

    def stream(self) -> TokenStream:
        return TokenStream([Shard(self.tokens, self.offsets)])


def check_files(files: list[str], text_field: str) -> list[Path]:
    """The files as paths; UserError naming the first that is missing or of a format training cannot read."""
    out = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise UserError(f"--data {name}: no such file; give text (.txt), JSONL (.jsonl) or parquet files")
        if not readers.detect_format(path, FORMATS):
            raise UserError(
                f"--data {name}: not a .txt, .jsonl(.gz/.zst) or .parquet file; give files of those formats"
            )
        if readers.detect_format(path, FORMATS) == "parquet":
            readers.check_parquet_column(path, text_field, "--text-field")
        out.append(path)
    return out


def tokenize_file(path: Path, tok: Tokenizer, text_field: str = "text") -> FileTokens:
    """The documents of ``path`` (training's reader) as ``<|endoftext|>`` + tokens each, back to back."""
    docs = [d.text for d in read_source(SourceConfig(path=str(path), text_field=text_field))]
    if not docs:
        raise UserError(f"--data {path}: no document with text (JSONL: is the text under {text_field!r}?)")
    pieces = [np.asarray([tok.eot_id, *ids], dtype=np.int64) for ids in tok.encode_batch(docs)]
    offsets = np.cumsum([0, *(len(p) for p in pieces)]).astype(np.int64)
    return FileTokens(path, len(docs), np.concatenate(pieces), offsets)


def windows(stream: TokenStream, seq_len: int, batch_size: int) -> Iterator[Batch]:
    """The validation windows of ``stream`` (:func:`eval_batches` over all of it), then the remaining
    targets as one shorter window."""
    full = (len(stream) - 1) // seq_len
    if full:
        yield from eval_batches(stream, seq_len, batch_size, full * seq_len)
    start = full * seq_len
    rest = len(stream) - 1 - start
    if rest > 0:
        w = stream.tokens(start, rest + 1)
        yield stack([(w[:-1], w[1:], stream.doc_index(start, rest))])


@torch.no_grad()
def score(
    objective: nn.Module, stream: TokenStream, seq_len: int, batch_size: int, precision: PrecisionPolicy
) -> tuple[float, int]:
    """(sum of next-token cross-entropies in nats, targets) over every window of ``stream``."""
    return loss_sum(objective, windows(stream, seq_len, batch_size), precision)


def evaluate_files(
    run_dir: str | Path, files: list[str], device: torch.device, text_field: str = "text"
) -> dict:
    """Loss and perplexity of the newest checkpoint of ``run_dir`` on each file and on all of them
    (mean over every target of every file): ``{"step", "files": [...], "loss", "ppl", "targets"}``."""
    paths = check_files(files, text_field)
    cfg, tok, model, step = load_run(run_dir, device)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    objective = NextTokenLoss(model, cfg.train.loss_chunk)
    mbs = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 8
    rows, total, count = [], 0.0, 0
    for path in paths:
        ft = tokenize_file(path, tok, text_field)
        loss_sum, n = score(objective, ft.stream(), cfg.data.seq_len, mbs, precision)
        rows.append(
            {
                "file": str(path),
                "documents": ft.documents,
                "tokens": len(ft.tokens),
                "targets": n,
                "loss": loss_sum / n,
                "ppl": perplexity(loss_sum / n),
            }
        )
        total, count = total + loss_sum, count + n
    return {
        "step": step,
        "files": rows,
        "loss": total / count,
        "ppl": perplexity(total / count),
        "targets": count,
    }
