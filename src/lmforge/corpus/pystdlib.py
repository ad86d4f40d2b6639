"""The built-in corpus, made from the running interpreter's standard library.

Two domains:

* ``code``: each ``.py`` source file of the standard library, one document per file;
* ``prose``: per module, its module, class and function docstrings in source order (one document per
  module), plus each topic of ``pydoc_data.topics`` (the language reference that ``help()`` shows).

Ids are ``pystdlib/code/<relative path>``, ``pystdlib/prose/<relative path>`` and
``pystdlib/prose/topics/<name>``; files are visited in sorted order, so the corpus is deterministic
for a given Python installation.
"""

from __future__ import annotations

import ast
import logging
import sysconfig
import tokenize
from collections.abc import Iterator
from pathlib import Path

from lmforge.corpus.document import Doc

log = logging.getLogger(__name__)

DOMAINS = ("code", "prose")

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = False) -> list[Path]:
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & _SKIP_DIRS or (not include_tests and parts & _TEST_DIRS):
            continue
        files.append(path)
    return sorted(files)


def topics_file() -> Path | None:
    """The file of ``pydoc_data.topics`` (read by :func:`read_topics`), None where it is stripped."""
    try:
        import pydoc_data.topics as topics
    except ImportError:  # some distributions strip pydoc_data
        return None
    return Path(topics.__file__)


def _docstrings(tree: ast.Module, module: str) -> list[str]:
    """Module, class and function docstrings in source order, each headed by its qualified name."""
    out: list[str] = []
    doc = ast.get_docstring(tree)
    if doc:
        out.append(f"{module}\n\n{doc}")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    out.append(f"{name}\n\n{doc}")
                visit(child, name)

    visit(tree, module)
    return out


def read_pystdlib(include_tests: bool = False) -> Iterator[Doc]:
    for path in stdlib_files(include_tests):
        yield from read_stdlib_file(path)
    yield from read_topics()


def read_stdlib_file(path: Path) -> Iterator[Doc]:
    """The ``code`` document of one standard-library file and its ``prose`` (docstrings) document."""
    rel = path.relative_to(stdlib_root()).as_posix()
    try:
        with tokenize.open(path) as fh:  # honours PEP 263 encoding declarations
            source = fh.read()
    except (SyntaxError, UnicodeDecodeError, OSError):
        log.debug("pystdlib: skipped unreadable %s", rel)
        return
    if source.strip():
        yield Doc(f"pystdlib/code/{rel}", source, "code")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    docs = _docstrings(tree, module)
    if docs:
        yield Doc(f"pystdlib/prose/{rel}", "\n\n".join(docs) + "\n", "prose")


def read_topics() -> Iterator[Doc]:
    """Each topic of ``pydoc_data.topics`` (the language reference ``help()`` shows) as a prose document."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    for name in sorted(topics):
        if topics[name].strip():
            yield Doc(f"pystdlib/prose/topics/{name}", topics[name], "prose")
