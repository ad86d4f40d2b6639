"""Build the tasks that ship with lmforge (``evaluate/task_data/``) from the Python standard library.

    python -m lmforge.evaluate.task_builder [OUT_DIR]

Deterministic for a given Python installation (files in sorted order, ``random.Random(SEED)``):

* ``stdlib_docstring`` (multiple choice, 4 choices): a function's ``def`` line and docstring; which body
  is its own (the others: bodies of 1-4 lines of other functions at the same indentation). From the
  library's modules, which the built-in ``pystdlib`` corpus trains on.
* ``stdlib_next_line`` (multiple choice, 4 choices): six lines of a test module; which line comes next
  (the others: lines of the same file at the same indentation).
* ``stdlib_assign`` (generate, exact match): four lines of a test module and the start of an assignment
  ``NAME = ``; the value, up to the end of the line.

The test modules (``Lib/test/``) are left out of the ``pystdlib`` corpus, so the last two are held out of
a run trained on it.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sys
from pathlib import Path

from lmforge.corpus.pystdlib import stdlib_files, stdlib_root

SEED = 20260
ASSIGN = re.compile(r"^(\s*[A-Za-z_][A-Za-z_0-9.]* = )(\S.{0,22})$")


def _bodies(path: Path) -> list[tuple[str, str, int]]:
    """(def line and docstring, body, indentation) of each function with a docstring and 1-4 short
    body lines."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or len(node.body) < 2 or ast.get_docstring(node) is None:
            continue
        doc, rest = node.body[0], node.body[1:]
        start, end = rest[0].lineno, rest[-1].end_lineno or rest[-1].lineno
        body = lines[start - 1 : end]
        if not 1 <= len(body) <= 4 or any(len(b) > 90 for b in body) or len(lines[doc.end_lineno - 1]) > 100:
            continue
        head = "\n".join(lines[node.lineno - 1 : doc.end_lineno]) + "\n"
        if len(head) > 600:
            continue
        out.append((head, "\n".join(body), node.col_offset))
    return out


def docstring_task(rng: random.Random, count: int) -> list[dict]:
    found = [b for p in stdlib_files() for b in _bodies(p)]
    items = []
    for head, body, indent in rng.sample(found, count):
        others = sorted({b for _, b, i in found if i == indent and b != body})
        choices = [body, *rng.sample(others, 3)]
        rng.shuffle(choices)
        items.append({"context": head, "choices": choices, "answer": choices.index(body)})
    return items


def test_modules() -> list[Path]:
    root = stdlib_root() / "test"
    return sorted(root.glob("test_*.py"))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def next_line_task(rng: random.Random, count: int) -> list[dict]:
    items: list[dict] = []
    files = test_modules()
    while len(items) < count:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines()
        if len(lines) < 50:
            continue
        at = rng.randrange(6, len(lines))
        line = lines[at]
        if not 10 <= len(line.strip()) <= 80 or not all(s.strip() for s in lines[at - 2 : at]):
            continue
        others = sorted(
            {s for s in lines if _indent(s) == _indent(line) and s != line and 10 <= len(s.strip()) <= 80}
        )
        if len(others) < 3:
            continue
        choices = [line, *rng.sample(others, 3)]
        rng.shuffle(choices)
        items.append(
            {
                "context": "\n".join(lines[at - 6 : at]) + "\n",
                "choices": choices,
                "answer": choices.index(line),
            }
        )
    return items


def assign_task(rng: random.Random, count: int) -> list[dict]:
    items: list[dict] = []
    files = test_modules()
    while len(items) < count:
        lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines()
        found = [i for i in range(4, len(lines)) if ASSIGN.match(lines[i])]
        if not found:
            continue
        at = rng.choice(found)
        head, value = ASSIGN.match(lines[at]).groups()
        items.append({"context": "\n".join(lines[at - 4 : at]) + "\n" + head, "answer": value.strip()})
    return items


SPECS = {
    "stdlib_docstring": (
        docstring_task, 80,
        'kind = "multiple_choice"\nmetric = "acc_norm"\ntarget_delimiter = ""\n',
        "which of 4 bodies belongs to a function's def line and docstring (library modules)",
    ),
    "stdlib_next_line": (
        next_line_task, 150,
        'kind = "multiple_choice"\nmetric = "acc"\ntarget_delimiter = ""\n',
        "which of 4 lines follows six lines of a test module (Lib/test, held out of pystdlib)",
    ),
    "stdlib_assign": (
        assign_task, 150,
        'kind = "generate"\nmetric = "exact_match"\nuntil = ["\\n"]\nmax_new_tokens = 16\n',
        "the value of an assignment NAME = ... in a test module, generated greedily (exact match)",
    ),
}  # fmt: skip


def build(out: Path) -> list[Path]:
    """Write each task's ``NAME.jsonl`` and ``NAME.toml`` into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    version = ".".join(str(v) for v in sys.version_info[:3])
    for name, (make, count, spec, what) in SPECS.items():
        items = make(random.Random(f"{SEED}:{name}"), count)
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items), encoding="utf-8")
        header = f"# {what}\n# built by python -m lmforge.evaluate.task_builder from Python {version}'s standard library\n"
        (out / f"{name}.toml").write_text(header + f'file = "{name}.jsonl"\n' + spec, encoding="utf-8")
        written += [data, out / f"{name}.toml"]
    return written


if __name__ == "__main__":
    from lmforge.evaluate.task_files import TASK_DATA

    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else TASK_DATA):
        print(p, p.stat().st_size)
