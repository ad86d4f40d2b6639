"""Downstream tasks scored on a model in memory (``evaluate/tasks.py`` runs them on a run folder's
checkpoint, the ``[eval]`` training callback on the current weights): task names resolved to tasks
(``evaluate/task_files.py``, ``evaluate/task_yaml.py``), multiple choice by log-likelihood and greedy
generation scored by the rules of ``evaluate/scoring.py``."""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import UserError
from lmforge.evaluate.loglikelihood import continuation_logprobs, split_pair
from lmforge.evaluate.scoring import binomial_stderr, choice_correct, cut_at_stops, exact_match, extract
from lmforge.evaluate.task_files import TASK_DATA, Task, read_spec
from lmforge.evaluate.task_yaml import read_yaml_task
from lmforge.model.sampling import generate_batch
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer


def shipped_tasks() -> list[str]:
    """Names of the tasks that ship with lmforge."""
    return sorted(p.stem for p in TASK_DATA.glob("*.toml"))


def resolve_tasks(names: str) -> list[Task]:
    """The tasks of ``--tasks NAME[,NAME...]``: shipped names or paths to ``.toml`` / ``.yaml`` specs."""
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        path = Path(name)
        if path.suffix in (".toml", ".yaml", ".yml"):
            if not path.is_file():
                raise UserError(f"--tasks {name}: no such file; give a task spec (.toml or lm-eval .yaml)")
        elif name in shipped_tasks():
            path = TASK_DATA / f"{name}.toml"
        else:
            raise UserError(
                f"--tasks {name}: no such task; shipped tasks: {', '.join(shipped_tasks())} "
                "(or give the path of a task spec .toml / lm-eval .yaml)"
            )
        if path.suffix == ".toml":
            out.append(read_spec(path))
        else:
            out.append(read_yaml_task(path))
    if not out:
        raise UserError(
            "--tasks: no task named; give NAME[,NAME...] (shipped: " + ", ".join(shipped_tasks()) + ")"
        )
    return out


def accuracy(hits: list[bool], metric: str) -> dict:
    """``{metric: mean, metric_stderr: binomial standard error}`` of right/wrong outcomes."""
    acc = sum(hits) / len(hits)
    return {metric: acc, f"{metric}_stderr": binomial_stderr(acc, len(hits))}


def score_multiple_choice(task: Task, model: Transformer, tok: Tokenizer, batch_size: int, autocast) -> dict:
    """``acc`` and ``acc_norm`` (with standard errors) of a multiple-choice task."""
    pairs, spans = [], []
    for item in task.items:
        spans.append((len(pairs), len(item.choices)))
        pairs += [split_pair(tok, item.context, task.continuation(c)) for c in item.choices]
    scores = continuation_logprobs(model, pairs, batch_size, autocast)
    acc, norm = [], []
    for item, (start, n) in zip(task.items, spans, strict=True):
        a, b = choice_correct([s for s, _ in scores[start : start + n]], list(item.choices), int(item.answer))
        acc.append(a)
        norm.append(b)
    return accuracy(acc, "acc") | accuracy(norm, "acc_norm")


def generations(task: Task, model: Transformer, tok: Tokenizer, batch_size: int) -> list[str]:
    """Each question's greedy continuation as text, cut at the task's first stop string."""
    keep = max(model.max_seq_len - task.max_new_tokens, 1)
    prompts = [[tok.eot_id, *tok.encode(item.context)][-keep:] for item in task.items]
    out = []
    for start in range(0, len(prompts), batch_size):
        ids = generate_batch(
            model, prompts[start : start + batch_size], task.max_new_tokens, temperature=0.0,
            stop_tokens=(tok.eot_id,),
        )  # fmt: skip
        out += [cut_at_stops(tok.decode(row), list(task.until)) for row in ids]
    return out


def score_generate(task: Task, model: Transformer, tok: Tokenizer, batch_size: int) -> dict:
    """``exact_match`` (with its standard error) of a generation task."""
    texts = generations(task, model, tok, batch_size)
    hits = [
        exact_match(extract(text, task.regex, task.group_select), str(item.answer))
        for text, item in zip(texts, task.items, strict=True)
    ]
    return accuracy(hits, "exact_match")


def with_value(task: Task, figures: dict) -> dict:
    """``{"kind", "metric", "value", "stderr", "n", "source", **figures}``: the task's metric first."""
    return {
        "kind": task.kind,
        "metric": task.metric,
        "value": figures[task.metric],
        "stderr": figures.get(f"{task.metric}_stderr"),
        "n": len(task.items) if task.items else figures["targets"],
        "source": task.source,
        **figures,
    }


def score_text_task(task: Task, model: Transformer, tok: Tokenizer, batch_size: int, autocast=None) -> dict:
    """A multiple-choice or generation task's figures (:func:`with_value`); ``autocast``: the context the
    log-likelihood forward passes run in."""
    if task.kind == "multiple_choice":
        return with_value(task, score_multiple_choice(task, model, tok, batch_size, autocast))
    if task.kind == "generate":
        return with_value(task, score_generate(task, model, tok, batch_size))
    raise ValueError(f"task {task.name}: a {task.kind} task is scored on a file (evaluate/tasks.py)")
