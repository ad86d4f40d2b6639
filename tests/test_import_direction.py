"""Data flows one way: ``lmforge.corpus`` (``lmforge data``) never imports ``lmforge.data`` or ``lmforge.train``.

Checked twice: statically (every import statement in ``src/lmforge/corpus``, also those inside
functions) and at run time (importing every corpus module, and every registered stage, in a fresh
interpreter loads no module of ``lmforge.data`` or ``lmforge.train``). The modules of ``corpus/`` and
``data/`` also import each other without cycles.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import lmforge
from lmforge.corpus.stages import registry

SRC = Path(lmforge.__file__).parent
FORBIDDEN = ("lmforge.data", "lmforge.train")
# The one exception: a model-based stage scores with a trained run, loaded by ``lmforge eval``'s loader
# (not a second copy of it). The import sits inside functions, so importing corpus still loads no
# training module (the run-time test below) until such a stage scores.
INSIDE_FUNCTIONS = {"corpus/lm_scorer.py": {"lmforge.evaluate.run_loading"}}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import in ``path``; ``from P import n`` gives ``P.n`` when that is a module."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (SRC.parent / sub.replace(".", "/")).with_suffix(".py").is_file() or (
                    SRC.parent / sub.replace(".", "/") / "__init__.py"
                ).is_file()
                yield node.lineno, sub if is_module else base


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _top_level_lines(path: Path) -> set[int]:
    """Lines of the imports at module level (run when the module is imported)."""
    body = ast.parse(path.read_text(), str(path)).body
    return {node.lineno for node in body if isinstance(node, ast.Import | ast.ImportFrom)}


def test_corpus_never_imports_data_or_train():
    files = sorted((SRC / "corpus").rglob("*.py"))
    assert len(files) > 15  # the walk found the package
    bad = [
        f"{path.relative_to(SRC)}:{line}: {module}"
        for path in files
        for line, module in _imports(path)
        if _forbidden(module)
        and not (
            module in INSIDE_FUNCTIONS.get(str(path.relative_to(SRC)), ())
            and line not in _top_level_lines(path)
        )
    ]
    assert not bad, "corpus/ must not import data/ or train/:\n" + "\n".join(bad)
    outside = [t for t in registry.STAGES.values() if not t.startswith("lmforge.corpus.stages.")]
    assert not outside, f"registered stages outside lmforge.corpus.stages: {outside}"


def test_importing_corpus_loads_no_training_module():
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import lmforge.corpus\n"
        "from lmforge.corpus.stages import registry\n"
        "for m in pkgutil.walk_packages(lmforge.corpus.__path__, 'lmforge.corpus.'):\n"
        "    importlib.import_module(m.name)\n"
        "for name in registry.STAGES:\n"
        "    registry.stage_class(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "lmforge.corpus.pipeline" in loaded and "lmforge.corpus.stages.dedup_minhash" in loaded
    assert [m for m in loaded if _forbidden(m)] == []


def test_corpus_and_data_have_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for folder in ("corpus", "data"):
        for path in sorted((SRC / folder).rglob("*.py")):
            name = _module_name(path)
            graph[name] = {
                m for _, m in _imports(path) if m.startswith(("lmforge.corpus", "lmforge.data")) and m != name
            }
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None
    assert order.index("lmforge.corpus.readers") < order.index("lmforge.data.sources")
