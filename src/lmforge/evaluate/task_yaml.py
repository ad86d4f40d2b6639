"""lm-evaluation-harness's YAML task format, the common subset, over local JSON-lines data.

Read: ``task``, ``dataset_path: json`` with ``dataset_kwargs: {data_files: FILE | [FILES] | {SPLIT:
FILE}}`` (a relative path: from the YAML's folder, else the current one; a file or list is the split
``train``, as the ``datasets`` library names it), ``test_split`` / ``validation_split`` (the split scored:
the first given), ``fewshot_split`` / ``training_split`` (where examples come from; else the other
questions), ``output_type: multiple_choice | generate_until``, ``doc_to_text``, ``doc_to_choice``,
``doc_to_target`` (a field name, or a Jinja template rendered with the document's fields, as the harness
renders them: ``StrictUndefined``, trailing newlines kept, its ``regex_replace`` filter),
``target_delimiter`` (default ``" "``), ``fewshot_delimiter`` (``"\\n\\n"``), ``num_fewshot``,
``description``, ``generation_kwargs`` (``until``, ``max_gen_toks``, greedy only), ``filter_list`` (one
filter: ``regex`` with ``regex_pattern`` / ``group_select``, then ``take_first``), ``metric_list``
(``acc``, ``acc_norm``, ``exact_match``; the first is the task's metric), and ``tag``, ``metadata``,
``dataset_name: null`` (ignored). Any other key, ``!function`` and ``include`` are refused in one line.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import jinja2
import yaml

from lmforge.errors import UserError
from lmforge.evaluate.task_files import Item, Task, with_fewshot

SUPPORTED = {
    "task", "dataset_path", "dataset_name", "dataset_kwargs", "test_split", "validation_split",
    "training_split", "fewshot_split", "output_type", "doc_to_text", "doc_to_choice", "doc_to_target",
    "target_delimiter", "fewshot_delimiter", "num_fewshot", "description", "generation_kwargs",
    "filter_list", "metric_list", "tag", "metadata",
}  # fmt: skip
OUTPUT_TYPES = {"multiple_choice": "multiple_choice", "generate_until": "generate"}


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0, ignorecase: bool = False) -> str:
    return re.compile(pattern, flags=re.I if ignorecase else 0).sub(repl, string, count=count)


ENV = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
ENV.filters["regex_replace"] = _regex_replace


def read_yaml_task(path: Path) -> Task:
    """The task of an lm-evaluation-harness YAML file over local data."""
    cfg = _load(path)
    where = str(path)
    unknown = sorted(set(cfg) - SUPPORTED)
    if unknown:
        raise UserError(
            f"{where}: key {unknown[0]!r} is not supported; lmforge reads {', '.join(sorted(SUPPORTED))}"
        )
    if cfg.get("dataset_path") != "json" or cfg.get("dataset_name") is not None:
        raise UserError(
            f"{where}: dataset_path must be json (local data files, no hub); got {cfg.get('dataset_path')!r}"
        )
    kind = OUTPUT_TYPES.get(cfg.get("output_type", ""))
    if kind is None:
        raise UserError(
            f"{where}: output_type {cfg.get('output_type')!r}; give multiple_choice or generate_until"
        )
    splits = _splits(cfg, path)
    split = cfg.get("test_split") or cfg.get("validation_split")
    if split not in splits:
        raise UserError(f"{where}: test_split {split!r} is not among the data_files splits {sorted(splits)}")
    metric, until, max_new, regex, group = _scoring(cfg, kind, where)
    task = Task(
        name=str(cfg.get("task", path.stem)),
        kind=kind,
        metric=metric,
        source=where,
        target_delimiter=str(cfg.get("target_delimiter", " ")),
        until=until,
        max_new_tokens=max_new,
        regex=regex,
        group_select=group,
    )
    items = [_item(cfg, kind, doc, w) for doc, w in _docs(splits[split])]
    shot_split = cfg.get("fewshot_split") or cfg.get("training_split")
    pool = None
    if shot_split is not None and shot_split != split:
        if shot_split not in splits:
            raise UserError(f"{where}: fewshot_split {shot_split!r} is not among the splits {sorted(splits)}")
        pool = [_item(cfg, kind, doc, w) for doc, w in _docs(splits[shot_split])]
    k = cfg.get("num_fewshot") or 0
    if not isinstance(k, int) or k < 0:
        raise UserError(f"{where}: num_fewshot = {k!r}; give an integer >= 0")
    delimiter = str(cfg.get("fewshot_delimiter", "\n\n"))
    return with_fewshot(task, items, k, 1234, delimiter, str(cfg.get("description", "")), path, pool)


def _load(path: Path) -> dict:
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.constructor.ConstructorError as exc:
        raise UserError(
            f"{path}: {exc.problem} (a !function or other tag runs Python code); lmforge reads templates only"
        ) from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not YAML ({str(exc).splitlines()[0]}); fix the file") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: not an lm-evaluation-harness task (a YAML mapping); fix the file")
    return cfg


def _splits(cfg: dict, path: Path) -> dict[str, list[Path]]:
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    extra = sorted(set(cfg.get("dataset_kwargs") or {}) - {"data_files"})
    if extra or files is None:
        raise UserError(
            f"{path}: dataset_kwargs takes data_files only (local JSON lines); got {extra or 'none'}"
        )
    if isinstance(files, str | list):
        files = {"train": files}
    out = {}
    for split, names in files.items():
        paths = []
        for name in [names] if isinstance(names, str) else names:
            p = Path(name)
            found = p if p.is_absolute() else (path.parent / p if (path.parent / p).is_file() else p)
            if not found.is_file():
                raise UserError(
                    f"{path}: data_files {name!r}: no such file (looked beside the YAML and in .)"
                )
            paths.append(found)
        out[str(split)] = paths
    return out


def _scoring(cfg: dict, kind: str, where: str) -> tuple[str, tuple[str, ...], int, str | None, int]:
    """(metric, until, max_new_tokens, regex, group_select) of the task's metric, generation and filter
    keys."""
    metrics = [m.get("metric") if isinstance(m, dict) else m for m in cfg.get("metric_list") or []]
    allowed = ("acc", "acc_norm") if kind == "multiple_choice" else ("exact_match",)
    for m in metrics:
        if m not in allowed:
            raise UserError(
                f"{where}: metric {m!r} is not supported for {cfg['output_type']}; give {allowed}"
            )
    for m in cfg.get("metric_list") or []:
        extra = sorted(set(m) - {"metric", "aggregation", "higher_is_better"}) if isinstance(m, dict) else []
        if extra or (isinstance(m, dict) and m.get("aggregation", "mean") != "mean"):
            raise UserError(f"{where}: metric_list option {(extra or ['aggregation'])[0]!r} is not supported")
    gen = cfg.get("generation_kwargs") or {}
    extra = sorted(set(gen) - {"until", "max_gen_toks", "do_sample", "temperature"})
    if extra or gen.get("do_sample") or gen.get("temperature", 0):
        raise UserError(
            f"{where}: generation_kwargs: greedy with until / max_gen_toks only; got {extra or gen}"
        )
    until = gen.get("until", [cfg.get("fewshot_delimiter", "\n\n")])
    regex, group = _filter(cfg.get("filter_list"), where)
    metric = metrics[0] if metrics else allowed[0]
    return (
        metric,
        tuple([until] if isinstance(until, str) else until),
        int(gen.get("max_gen_toks", 256)),
        regex,
        group,
    )


def _filter(filters: Any, where: str) -> tuple[str | None, int]:
    if not filters:
        return None, 0
    steps = filters[0].get("filter", []) if len(filters) == 1 and isinstance(filters[0], dict) else None
    names = [s.get("function") for s in steps or []]
    if steps is None or names not in (["regex", "take_first"], ["regex"], ["take_first"]):
        raise UserError(
            f"{where}: filter_list: one filter of regex then take_first is supported; got {filters}"
        )
    regex = steps[0] if names[0] == "regex" else {}
    return regex.get("regex_pattern", r"#### (\-?[0-9\.\,]+)") if regex else None, int(
        regex.get("group_select", 0)
    )


def _docs(paths: list[Path]) -> list[tuple[dict, str]]:
    out = []
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: not JSON ({exc.msg}); one object per line") from None
            if not isinstance(doc, dict):
                raise UserError(f"{path}:{n}: not a JSON object")
            out.append((doc, f"{path}:{n}"))
    return out


def _render(spec: Any, doc: dict, where: str, key: str) -> Any:
    """A field's value (``spec`` names a field), an int as given, else the rendered template."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        return spec
    if isinstance(spec, list):
        return [_render(s, doc, where, key) for s in spec]
    if not isinstance(spec, str):
        raise UserError(f"{where}: {key} is missing or not a template; give a field name or a Jinja template")
    if spec in doc:
        return doc[spec]
    try:
        return ENV.from_string(spec).render(**doc)
    except jinja2.UndefinedError as exc:
        raise UserError(f"{where}: {key}: {exc.message}; the line lacks a field the template uses") from None
    except jinja2.TemplateError as exc:
        raise UserError(f"{where}: {key}: bad Jinja template ({exc})") from None


def _item(cfg: dict, kind: str, doc: dict, where: str) -> Item:
    text = _render(cfg.get("doc_to_text"), doc, where, "doc_to_text")
    target = _render(cfg.get("doc_to_target"), doc, where, "doc_to_target")
    if kind == "generate":
        answer = target if isinstance(target, str) else str(target)
        return Item(str(text), str(text), (), answer, where)
    choices = _render(cfg.get("doc_to_choice"), doc, where, "doc_to_choice")
    if isinstance(choices, str):
        try:
            choices = ast.literal_eval(choices)
        except (ValueError, SyntaxError):
            raise UserError(f"{where}: doc_to_choice renders {choices[:40]!r}, not a list") from None
    if not isinstance(choices, list | tuple) or len(choices) < 2:
        raise UserError(f"{where}: doc_to_choice gives {choices!r}; give a list of at least 2 choices")
    choices = [str(c) for c in choices]
    if isinstance(target, str):
        target = int(target) if target.strip().isdigit() else target
    if isinstance(target, str):
        if target not in choices:
            raise UserError(f"{where}: doc_to_target {target!r} is none of the choices")
        target = choices.index(target)
    if not 0 <= target < len(choices):
        raise UserError(
            f"{where}: answer {target} is out of range for {len(choices)} choices; give an index 0..{len(choices) - 1}"
        )
    return Item(str(text), str(text), tuple(choices), target, where)
