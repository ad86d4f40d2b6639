"""Downstream tasks read from local files: a task spec (TOML) naming a JSONL file (lm-evaluation-harness's
YAML format: ``evaluate/task_yaml.py``; names resolved: ``evaluate/tasks.py::resolve_tasks``).

A task spec (``NAME.toml``)::

    kind = "multiple_choice"      # or "generate", or "loss"
    file = "NAME.jsonl"           # relative to the spec's folder
    metric = "acc_norm"           # multiple_choice: acc | acc_norm; generate: exact_match; loss: bits_per_byte
    num_fewshot = 0               # solved examples before each question
    target_delimiter = ""         # between the context and a choice (or the answer of an example)

JSONL lines: ``{"context": str, "choices": [str, ...], "answer": int}`` (multiple choice: the index of the
right choice) or ``{"context": str, "answer": str}`` (generate). A ``loss`` task's file is text as
``lmforge eval --data`` reads it. Every problem is a :class:`~lmforge.errors.UserError` naming the file
(and line) before any model is loaded.
"""

from __future__ import annotations

import json
import random
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

TASK_DATA = Path(__file__).parent / "task_data"
KINDS = ("multiple_choice", "generate", "loss")
METRICS = {"multiple_choice": ("acc", "acc_norm"), "generate": ("exact_match",), "loss": ("bits_per_byte",)}
SPEC_KEYS = {
    "name", "kind", "file", "metric", "num_fewshot", "fewshot_seed", "target_delimiter",
    "fewshot_delimiter", "description", "until", "max_new_tokens", "regex", "group_select", "text_field",
}  # fmt: skip


@dataclass(frozen=True)
class Item:
    """One question: its own ``text``, the ``context`` the model sees (description and examples first),
    the ``choices`` (multiple choice), the ``answer`` (an index, or the text to generate), and where it
    was read (``file:line``)."""

    text: str
    context: str
    choices: tuple[str, ...]
    answer: int | str
    where: str


@dataclass
class Task:
    """A task, whatever file it came from: what is scored and how (``evaluate/scoring.py``)."""

    name: str
    kind: str
    metric: str
    source: str
    items: list[Item] = field(default_factory=list)
    target_delimiter: str = ""
    until: tuple[str, ...] = ("\n\n",)
    max_new_tokens: int = 64
    regex: str | None = None
    group_select: int = 0
    files: tuple[Path, ...] = ()  # loss
    text_field: str = "text"

    def continuation(self, choice: str) -> str:
        return self.target_delimiter + choice


def read_spec(path: Path) -> Task:
    """The task of a TOML spec and its JSONL file."""
    try:
        spec = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not a TOML task spec ({exc}); fix the file") from None
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise UserError(
            f"{path}: unknown key {unknown[0]!r}; a task spec takes {', '.join(sorted(SPEC_KEYS))}"
        )
    kind = spec.get("kind")
    if kind not in KINDS:
        raise UserError(f"{path}: kind = {kind!r}; give one of {', '.join(KINDS)}")
    metric = spec.get("metric", METRICS[kind][0])
    if metric not in METRICS[kind]:
        raise UserError(
            f"{path}: metric = {metric!r} for a {kind} task; give one of {', '.join(METRICS[kind])}"
        )
    if not isinstance(spec.get("file"), str):
        raise UserError(f"{path}: file is missing; name the task's data file (relative to the spec)")
    data = (path.parent / spec["file"]).resolve()
    if not data.is_file():
        raise UserError(f"{path}: file {spec['file']!r}: no such file {data}")
    task = Task(
        name=spec.get("name", path.stem),
        kind=kind,
        metric=metric,
        source=str(path),
        target_delimiter=_typed(spec, "target_delimiter", str, "", path),
        until=tuple(_typed(spec, "until", list, ["\n\n"], path)),
        max_new_tokens=_typed(spec, "max_new_tokens", int, 64, path),
        regex=_typed(spec, "regex", str, None, path),
        group_select=_typed(spec, "group_select", int, 0, path),
        text_field=_typed(spec, "text_field", str, "text", path),
    )
    if kind == "loss":
        return replace(task, files=(data,))
    items = read_jsonl(data, kind)
    return with_fewshot(
        task,
        items,
        _typed(spec, "num_fewshot", int, 0, path),
        _typed(spec, "fewshot_seed", int, 1234, path),
        _typed(spec, "fewshot_delimiter", str, "\n\n", path),
        _typed(spec, "description", str, "", path),
        path,
    )


def _typed(spec: dict, key: str, kind: type, default: Any, path: Path) -> Any:
    value = spec.get(key, default)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise UserError(f"{path}: {key} = {value!r}; give a {kind.__name__}")
    if isinstance(value, int) and value < 0:
        raise UserError(f"{path}: {key} = {value}; give an integer >= 0")
    return value


def read_jsonl(path: Path, kind: str) -> list[Item]:
    """The questions of a JSONL task file; UserError naming ``file:line`` of the first bad one."""
    items = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: not JSON ({exc.msg}); one object per line") from None
            items.append(item_of(doc, kind, f"{path}:{n}"))
    if not items:
        raise UserError(f"{path}: no question in the file; give one JSON object per line")
    return items


def item_of(doc: Any, kind: str, where: str) -> Item:
    """One question from a JSON object ``{"context", "choices", "answer"}`` (or ``{"context", "answer"}``)."""
    need = ("context", "choices", "answer") if kind == "multiple_choice" else ("context", "answer")
    if not isinstance(doc, dict):
        raise UserError(f"{where}: not a JSON object; give {{{', '.join(need)}}}")
    for key in need:
        if key not in doc:
            raise UserError(f"{where}: missing field {key!r}; each line needs {', '.join(need)}")
    if not isinstance(doc["context"], str):
        raise UserError(f"{where}: context is not a string")
    if kind != "multiple_choice":
        if not isinstance(doc["answer"], str):
            raise UserError(f"{where}: answer is not a string; a generate task's answer is the text")
        return Item(doc["context"], doc["context"], (), doc["answer"], where)
    choices, answer = doc["choices"], doc["answer"]
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise UserError(f"{where}: choices must be a list of at least 2 non-empty strings")
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise UserError(
            f"{where}: answer {answer!r} is out of range for {len(choices)} choices; "
            f"give an index 0..{len(choices) - 1}"
        )
    return Item(doc["context"], doc["context"], tuple(choices), answer, where)


def target_text(item: Item) -> str:
    """The right continuation of a question: its answer's choice, or the answer text."""
    return item.choices[item.answer] if isinstance(item.answer, int) else item.answer


def with_fewshot(
    task: Task,
    items: list[Item],
    k: int,
    seed: int,
    delimiter: str,
    description: str,
    where: Path,
    pool: list[Item] | None = None,
) -> Task:
    """``task`` with its questions, each led by ``description`` and ``k`` solved examples
    (``text + target_delimiter + target``, joined and followed by ``delimiter``) drawn with
    ``random.Random(seed + i)`` for question ``i`` from ``pool`` (default: the other questions)."""
    source = items if pool is None else pool
    if k and len(source) - (pool is None) < k:
        raise UserError(f"{where}: num_fewshot = {k} but only {len(source)} examples to draw from")
    out = []
    for i, item in enumerate(items):
        shots: list[Item] = []
        if k:
            picks = random.Random(seed + i).sample(range(len(source)), min(k + 1, len(source)))
            shots = [source[j] for j in picks if pool is not None or j != i][:k]
        parts = [s.text + task.target_delimiter + target_text(s) for s in shots]
        context = description + "".join(p + delimiter for p in parts) + item.text
        out.append(replace(item, context=context))
    return replace(task, items=out)
