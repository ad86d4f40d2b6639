"""``lmforge tokenizers compare --train-steps N``: the same small model trained on each tokenizer.

Only ``data.tokenizer`` differs between the runs: model size, ``data.seq_len``, batch, learning rate,
schedule and ``train.seed`` are :data:`MODEL_OVERRIDES` and the flags. Each run is an ordinary
``lmforge train`` run (:func:`lmforge.train.launch.train`) in ``OUT/runs/<kind>-<vocab>`` on every
document of the comparison, whose validation split is the comparison's held-out split
(:func:`lmforge.data.tokenizer_compare.write_jsonl`); after N steps every held-out document is scored
as ``lmforge eval --data`` scores files (:func:`lmforge.evaluate.files.evaluate_files`) and the summed
loss is turned into bits per byte (:func:`lmforge.data.tokenizer_compare.bits_per_byte`).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lmforge.corpus.document import Doc
from lmforge.data.tokenizer_compare import (
    ALL,
    CompareSettings,
    bits_per_byte,
    compare,
    docs_folder,
    held_out_folder,
)
from lmforge.evaluate.files import evaluate_files
from lmforge.recipe import load_config
from lmforge.tokenizer import Tokenizer
from lmforge.train.launch import train

MODEL_OVERRIDES: dict = {
    "model.n_layers": 2,
    "model.d_model": 128,
    "model.n_heads": 4,
    "data.seq_len": 128,
    "train.micro_batch_size": 8,
    "train.precision": "fp32",
    "train.compile": False,
    "train.eval_tokens": 4096,  # the run's own check; bits per byte scores every held-out document
    "train.log_interval": 50,
    "train.sample_tokens": 0,
    "train.keep_checkpoints": 1,
    "optim.lr": 3e-3,
}


def model_overrides(tok_path: Path, domains: list[str], s: CompareSettings) -> dict:
    """The run's config overrides: :data:`MODEL_OVERRIDES`, the comparison's documents and this tokenizer."""
    return {
        **MODEL_OVERRIDES,
        "data.sources": [
            {"path": str(docs_folder(s.out) / f"{d}.jsonl"), "domain": d, "format": "jsonl"} for d in domains
        ],
        "data.tokenizer": str(tok_path),
        "data.vocab_size": Tokenizer(tok_path).vocab_size,
        "data.val_fraction": s.held_out_fraction,
        "data.cache_dir": str(s.out / "work" / "cache"),
        "train.steps": s.train_steps,
        "train.seed": s.seed,
        "train.eval_interval": s.train_steps,
        "train.checkpoint_interval": 0,
        "schedule.warmup": 0.1 if s.train_steps >= 10 else 0,
    }


def train_and_score(
    tok_path: Path, domains: list[str], held: Sequence[Doc], s: CompareSettings, run_dir: Path
) -> dict:
    """Train the small model on ``tok_path`` for ``s.train_steps`` steps, score every held-out document and
    return loss per token (nats) and bits per byte per domain and over all (``"all"``)."""
    over = model_overrides(tok_path, domains, s)
    cfg = load_config(None, over)
    shutil.rmtree(run_dir, ignore_errors=True)  # this comparison's own run folder of an earlier call
    t0 = time.perf_counter()
    summary = train(cfg, run_dir, progress_bar=False)
    seconds = time.perf_counter() - t0
    if summary.get("stopped"):  # a signal: the run kept its checkpoint; the comparison stops here
        raise KeyboardInterrupt
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {
        "steps": summary["step"],
        "parameters": summary["parameters"],
        "tokens_seen": summary["tokens_seen"],
        "train_seconds": seconds,
        "config": {k: v for k, v in over.items() if k not in ("data.sources", "data.tokenizer")},
        "domains": {},
    }
    nll_all, bytes_all, targets_all = 0.0, 0, 0
    for d in domains:
        docs = [x for x in held if x.domain == d]
        if not docs:
            continue
        out = evaluate_files(run_dir, [str(held_out_folder(s.out) / f"{d}.jsonl")], device)
        nll = out["loss"] * out["targets"]
        n_bytes = sum(len(x.text.encode("utf-8")) for x in docs)
        result["domains"][d] = _row(nll, out["targets"], n_bytes)
        nll_all, bytes_all, targets_all = nll_all + nll, bytes_all + n_bytes, targets_all + out["targets"]
    result["domains"][ALL] = _row(nll_all, targets_all, bytes_all)
    return result


def _row(nll: float, targets: int, n_bytes: int) -> dict:
    return {
        "loss_per_token": nll / targets,
        "targets": targets,
        "bytes": n_bytes,
        "bpb": bits_per_byte(nll, n_bytes),
    }


def run_compare(s: CompareSettings, say: Callable[[str], None]) -> dict:
    """The whole command: :func:`compare` (with the model when ``s.train_steps``), then ``compare.png``."""
    from lmforge.report.charts import tokenizer_compare_chart

    result = compare(s, train_and_score if s.train_steps else None, say)
    tokenizer_compare_chart(result, s.out / "compare.png")
    return result
