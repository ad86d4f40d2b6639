"""The house as ``docs/architecture.md`` draws it: every room where its name says.

``train/`` holds the loop only (fewer than 20 files); at the top of ``src/lmforge`` there are only the
command (``cli/``), the schema, the recipe reader, the errors, the progress reporter and the precision
policy beside the packages; no function anywhere is longer than 100 lines; the command's entry points work.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import lmforge

SRC = Path(lmforge.__file__).parent
ROOT = SRC.parent.parent

TOP_MODULES = {"__init__", "__main__", "cli", "config", "recipe", "errors", "progress", "precision"}
PACKAGES = {
    "cli", "tokenizer", "corpus", "data", "model", "optim", "parallel", "plan", "posttrain", "train", "evaluate",
    "probes", "hf", "report", "web", "experiment",
}  # fmt: skip
MAX_FUNCTION_LINES = 100


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_train_holds_the_loop_only():
    files = _files(SRC / "train")
    assert len(files) < 20, f"train/ has {len(files)} files (at most 19): " + ", ".join(
        str(p.relative_to(SRC)) for p in files
    )
    assert {p.name for p in files} >= {"build.py", "trainer.py", "step.py", "checkpoint.py", "launch.py"}


def test_top_level_holds_only_the_command_schema_recipe_errors_progress_and_precision():
    modules = {p.stem for p in SRC.glob("*.py")} | {
        p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()
    }
    assert modules - PACKAGES == TOP_MODULES - {"cli"}
    assert {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()} == PACKAGES
    assert (SRC / "cli" / "__init__.py").is_file() and not (SRC / "cli.py").exists()


def test_no_function_is_longer_than_100_lines():
    long = [
        f"{path.relative_to(SRC)}::{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


def test_the_command_entry_points():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["lmforge"].partition(":")
    assert (module, attr) == ("lmforge.cli", "main")
    assert callable(getattr(importlib.import_module(module), attr))
    out = subprocess.run([sys.executable, "-m", "lmforge", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for command in ("train", "data", "sft", "dpo", "eval", "generate", "estimate", "dashboard", "export"):
        assert command in out.stdout


def test_where_each_command_lives_is_true():
    """Every row of ``docs/architecture.md``'s command table names a cli module that registers the command
    and library functions that exist."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Where each command's code lives", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `lmforge ")]
    assert len(rows) >= 19
    parser = importlib.import_module("lmforge.cli").build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # the registered command names
    from lmforge.cli.data import SUBCOMMANDS

    for row in rows:
        command, cli_module, entry = (cell.strip() for cell in row.strip("|").split("|"))
        cli_path = SRC / cli_module.strip("`")
        assert cli_path.is_file(), row
        for name in re.findall(r"`(?:lmforge )?([a-z -]+)`", command):
            first, *rest = name.split()
            assert first in commands, f"{first}: no such command ({row})"
            if first == "data" and rest:
                assert rest[0] in SUBCOMMANDS and cli_path.name == "data.py", row
            else:
                assert f'"{first}"' in cli_path.read_text(), f"{cli_path.name} does not register {first}"
        for path, name in re.findall(r"`([a-z_/]+)\.py::([a-z_]+)`", entry):
            module = importlib.import_module("lmforge." + path.replace("/", "."))
            assert callable(getattr(module, name, None)), f"{path}.py::{name} ({row})"
