"""``lmforge eval RUN --tasks NAME[,NAME...]``: downstream tasks scored on a run's newest checkpoint.

Tasks come from ``evaluate/task_files.py`` (shipped names, TOML specs, lm-evaluation-harness YAML) and
are all read and checked before the model is loaded. Per kind (``evaluate/scoring.py`` has the rules):

* ``multiple_choice``: every (context, choice) pair scored by :func:`continuation_logprobs`; ``acc`` and
  ``acc_norm`` with their standard errors;
* ``generate``: greedy generation (``model/sampling.py::generate_batch``, stopping at
  ``<|endoftext|>`` or ``max_new_tokens``), cut at the first stop string, the extractor, exact match;
* ``loss``: the file scored as ``lmforge eval --data`` scores it (``evaluate/files.py``), with bits per
  byte of its documents' UTF-8 text.

The result is printed and written to ``RUN/eval/tasks_step_N.json`` (tasks scored earlier at the same
step are kept, a task scored again is replaced).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lmforge.config import SourceConfig
from lmforge.data.sources import read_source
from lmforge.errors import UserError
from lmforge.evaluate.files import check_files, score, tokenize_file
from lmforge.evaluate.run_loading import load_run, pick_checkpoint
from lmforge.evaluate.scoring import (
    bits_per_byte,
)
from lmforge.evaluate.task_files import Task
from lmforge.evaluate.task_scoring import resolve_tasks, score_text_task, with_value
from lmforge.evaluate.validation import perplexity
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import Tokenizer


def check_tokenizer(run_dir: Path) -> None:
    """UserError when the run folder has no ``tokenizer.json`` (task texts need it)."""
    if not (run_dir / "tokenizer.json").is_file():
        raise UserError(
            f"--tasks: {run_dir} has no tokenizer.json; tasks are text and need the run's tokenizer "
            "(score token files with lmforge eval RUN instead)"
        )


def score_loss(
    task: Task, model: Transformer, tok: Tokenizer, seq_len: int, batch_size: int, precision: PrecisionPolicy
) -> dict:
    """Loss (nats per target token), perplexity and bits per byte of a loss task's file."""
    path = task.files[0]
    ft = tokenize_file(path, tok, task.text_field)
    nats, n = score(NextTokenLoss(model), ft.stream(), seq_len, batch_size, precision)
    n_bytes = sum(
        len(d.text.encode("utf-8"))
        for d in read_source(SourceConfig(path=str(path), text_field=task.text_field))
    )
    return {
        "loss": nats / n,
        "ppl": perplexity(nats / n),
        "bits_per_byte": bits_per_byte(nats, n_bytes),
        "targets": n,
        "bytes": n_bytes,
    }


def score_task(
    task: Task, model: Transformer, tok: Tokenizer, seq_len: int, batch_size: int, precision: PrecisionPolicy
) -> dict:
    """One task's figures (``evaluate/task_scoring.py::with_value``); a loss task in windows of ``seq_len``."""
    if task.kind == "loss":
        return with_value(task, score_loss(task, model, tok, seq_len, batch_size, precision))
    return score_text_task(task, model, tok, batch_size, precision.autocast())


def run_tasks(
    run_dir: str | Path,
    names: str,
    device: torch.device,
    batch_size: int = 16,
    limit: int = 0,
    step: int | None = None,
) -> dict:
    """Score the tasks ``names`` (``NAME[,NAME...]``) on checkpoint ``step`` of ``run_dir`` (None: the
    newest); every task file and the run are checked first. ``limit``: the first that many questions of each task (0:
    all). Returns ``{"step", "tasks": {name: figures}, "file"}`` and writes it to the run's
    ``eval/tasks_step_N.json``."""
    run_dir = Path(run_dir)
    if limit < 0 or batch_size < 1:
        raise UserError(
            f"--limit {limit} / --batch-size {batch_size}: give --limit >= 0 and --batch-size >= 1"
        )
    tasks = resolve_tasks(names)
    for task in tasks:
        if task.kind == "loss":
            check_files([str(p) for p in task.files], task.text_field)
        elif limit:
            task.items = task.items[:limit]
    pick_checkpoint(run_dir, step)
    check_tokenizer(run_dir)
    cfg, tok, model, step = load_run(run_dir, device, step)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    results = score_tasks(tasks, model, tok, cfg.data.seq_len, batch_size, precision)
    path = write_results(run_dir, step, results)
    return {"step": step, "tasks": results, "file": str(path)}


def score_tasks(
    tasks: list[Task],
    model: Transformer,
    tok: Tokenizer,
    seq_len: int,
    batch_size: int,
    precision: PrecisionPolicy,
) -> dict[str, dict]:
    """``{name: figures}`` of each task on ``model`` (any weights: a checkpoint's, or freshly drawn)."""
    return {t.name: score_task(t, model, tok, seq_len, batch_size, precision) for t in tasks}


def write_results(run_dir: Path, step: int, results: dict) -> Path:
    """``RUN/eval/tasks_step_N.json``: the earlier results of step N with these laid over them, written
    atomically."""
    path = run_dir / "eval" / f"tasks_step_{step}.json"
    path.parent.mkdir(exist_ok=True)
    old = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text()).get("tasks", {})
        except (json.JSONDecodeError, AttributeError):
            old = {}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "tasks": old | results}, indent=1) + "\n")
    os.replace(tmp, path)
    return path
