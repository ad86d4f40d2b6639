"""Reading post-training records from JSONL files: SFT examples and preference pairs.

Each line is one record; its format is recognised per record:

* SFT: ``{"instruction", "input"?, "output"}`` (a non-empty ``input`` follows the instruction after a blank
  line), ``{"messages": [{"role", "content"}, ...]}`` or ``{"prompt", "completion"}``.
* Pairs: ``{"prompt": str, "chosen": str, "rejected": str}``; the chat form with ``prompt`` a list of
  messages and ``chosen`` / ``rejected`` lists of assistant messages (or strings); or ``chosen`` /
  ``rejected`` as whole conversations that share the prompt as their common prefix (``prompt`` absent, or
  repeated at their start). An optional number ``margin`` (how much better the chosen response is: the
  reward model's margin, Llama 2's) goes with the pair.

A record that cannot be used is never dropped silently: it comes back as a :class:`BadRecord` with its
``path:line`` and a one-line reason naming the field. Blank lines are not records. A missing file is a
:class:`~lmforge.errors.UserError` naming the config key the files came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lmforge.errors import UserError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class Example:
    """One SFT record: the conversation; the loss is on its assistant turns."""

    turns: tuple[Turn, ...]
    source: str  # "path:line", 1-based line


@dataclass(frozen=True)
class Pair:
    """One preference record: a prompt ending with a user turn and two assistant responses."""

    prompt: tuple[Turn, ...]
    chosen: tuple[Turn, ...]
    rejected: tuple[Turn, ...]
    source: str
    margin: float | None = None  # the record's "margin" (the reward model's loss), None when absent


@dataclass(frozen=True)
class BadRecord:
    source: str  # "path:line"
    reason: str  # one line naming the field


class _Bad(Exception):
    """A record's problem, raised while parsing it and turned into a :class:`BadRecord`."""


T = TypeVar("T")


def read_examples(
    paths: Sequence[str | Path], system_prompt: str | None = None, key: str = "posttrain.train_files"
) -> tuple[list[Example], list[BadRecord]]:
    """SFT examples of ``paths`` in file and line order, and the records that could not be used.

    ``system_prompt`` becomes the first turn of every conversation that has no system turn; ``key`` is
    the config key the paths came from (named by the error for a missing file)."""
    return _read(paths, key, lambda obj, src: _example(obj, src, system_prompt))


def read_pairs(
    paths: Sequence[str | Path], system_prompt: str | None = None, key: str = "posttrain.train_files"
) -> tuple[list[Pair], list[BadRecord]]:
    """Preference pairs of ``paths`` in file and line order, and the records that could not be used."""
    return _read(paths, key, lambda obj, src: _pair(obj, src, system_prompt))


def _read(
    paths: Sequence[str | Path], key: str, parse: Callable[[object, str], T]
) -> tuple[list[T], list[BadRecord]]:
    for p in paths:
        if not Path(p).is_file():
            raise UserError(f"{key}: {p} is not a file; give existing JSONL files of records")
    good: list[T] = []
    bad: list[BadRecord] = []
    for path in paths:
        for source, line in _lines(Path(path)):
            try:
                good.append(parse(_json(line), source))
            except _Bad as exc:
                bad.append(BadRecord(source, str(exc)))
    return good, bad


def _lines(path: Path) -> Iterator[tuple[str, str | bytes]]:
    with path.open("rb") as f:
        for i, raw in enumerate(f, start=1):
            if raw.strip():
                yield f"{path}:{i}", raw


def _json(raw: str | bytes) -> object:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise _Bad(f"not JSON: not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Bad(f"not JSON: {exc.msg} at column {exc.colno}") from None


def _object(obj: object) -> dict:
    if not isinstance(obj, dict):
        raise _Bad(f"not an object: the line holds a JSON {type(obj).__name__}, expected {{...}}")
    return obj


def _string(obj: dict, field: str, name: str | None = None) -> str:
    name = name or field
    if field not in obj:
        raise _Bad(f"missing field {name}")
    value = obj[field]
    if not isinstance(value, str):
        raise _Bad(f"field {name} is a {type(value).__name__}, expected a string")
    return value


def _response(text: str, name: str) -> str:
    if not text.strip():
        raise _Bad(f"empty response: field {name} is empty")
    return text


def _messages(value: object, name: str) -> list[Turn]:
    if not isinstance(value, list):
        raise _Bad(f"field {name} is a {type(value).__name__}, expected a list of messages")
    turns = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise _Bad(f"field {where} is a {type(msg).__name__}, expected a {{role, content}} object")
        role = _string(msg, "role", f"{where}.role")
        if role not in ROLES:
            raise _Bad(f"unknown role {role!r} in {where}.role; expected one of {', '.join(ROLES)}")
        content = _string(msg, "content", f"{where}.content")
        if role == "assistant":
            _response(content, f"{where}.content")
        turns.append(Turn(role, content))
    return turns


def _with_system(turns: list[Turn], system_prompt: str | None) -> tuple[Turn, ...]:
    if system_prompt is not None and not any(t.role == "system" for t in turns):
        turns = [Turn("system", system_prompt), *turns]
    return tuple(turns)


def _example(obj: object, source: str, system_prompt: str | None) -> Example:
    rec = _object(obj)
    if "messages" in rec:
        turns = _messages(rec["messages"], "messages")
        if not any(t.role == "assistant" for t in turns):
            raise _Bad("no assistant turn in field messages")
    elif "instruction" in rec or "output" in rec:
        instruction = _string(rec, "instruction")
        extra = _string(rec, "input") if rec.get("input") is not None else ""
        user = f"{instruction}\n\n{extra}" if extra else instruction
        turns = [Turn("user", user), Turn("assistant", _response(_string(rec, "output"), "output"))]
    elif "prompt" in rec or "completion" in rec:
        if "chosen" in rec or "rejected" in rec:
            raise _Bad("field chosen/rejected: a preference pair, not an SFT record; use lmforge dpo")
        prompt = _string(rec, "prompt")
        completion = _response(_string(rec, "completion"), "completion")
        turns = [Turn("user", prompt), Turn("assistant", completion)]
    else:
        raise _Bad("missing field messages, instruction/output or prompt/completion")
    return Example(_with_system(turns, system_prompt), source)


def _side(rec: dict, field: str) -> list[Turn]:
    """``chosen`` or ``rejected`` as turns: a string is one assistant turn."""
    if field not in rec:
        raise _Bad(f"missing field {field}")
    value = rec[field]
    if isinstance(value, str):
        return [Turn("assistant", _response(value, field))]
    return _messages(value, field)


def _common_prompt(chosen: list[Turn], rejected: list[Turn]) -> int:
    """Length of the shared prefix of two conversations, cut back to end with its last user turn."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and chosen[n - 1].role != "user":
        n -= 1
    return n


def _pair(obj: object, source: str, system_prompt: str | None) -> Pair:
    rec = _object(obj)
    chosen, rejected = _side(rec, "chosen"), _side(rec, "rejected")
    if "prompt" in rec:
        raw = rec["prompt"]
        prompt = [Turn("user", raw)] if isinstance(raw, str) else _messages(raw, "prompt")
        for side in (chosen, rejected):
            if side[: len(prompt)] == prompt:  # whole conversations repeating the prompt
                del side[: len(prompt)]
    elif isinstance(rec["chosen"], list) and isinstance(rec["rejected"], list):
        n = _common_prompt(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    else:
        raise _Bad("missing field prompt")
    if not prompt or prompt[-1].role != "user":
        raise _Bad("field prompt must end with a user turn")
    if not any(t.content.strip() for t in prompt):
        raise _Bad("field prompt is empty")
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if not side:
            raise _Bad(f"no assistant turn in field {name} after the prompt")
        for t in side:
            if t.role != "assistant":
                raise _Bad(f"field {name} holds a {t.role} turn after the prompt; expected assistant turns")
    margin = rec.get("margin")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin)
    ):
        raise _Bad(f"field margin must be a finite number, not {margin!r}")
    prompt = _with_system(prompt, system_prompt)
    return Pair(prompt, tuple(chosen), tuple(rejected), source, None if margin is None else float(margin))
