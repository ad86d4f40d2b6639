"""The post-training demonstration's data: "what does this object do?" questions about the standard library.

The default pretraining run (``builtin:pystdlib``, ``data.include_tests = false``) learned from the standard
library's sources; the demonstration fine-tunes it to answer a question about a module, class, function or
method with the first paragraph of that object's docstring. The objects come from ``ast`` on the same files
the pystdlib corpus reads (:func:`lmforge.corpus.pystdlib.stdlib_files`: no test suites, no
``site-packages``); no module is imported.

Every object found is either kept (one SFT record and one DPO pair) or skipped for one reason, checked in
this order: ``local`` (defined inside a function), ``private_name`` (a part of its dotted name starts with
``_`` and is not a dunder), ``no_docstring``, ``uninformative`` (an answer under two words, or just the
object's name), ``too_long`` (instruction + input + output over
``max_len_chars`` characters), ``duplicate_docstring`` (the cleaned answer of an object met earlier, in
sorted file order and source order, so no answer is in both splits).

Whole modules go to validation: a module is held out when the seeded hash of its dotted name falls under
``val_fraction`` (:func:`held_out`), so no validation question is about a module seen in fine-tuning.
The DPO ``rejected`` answer is another kept object's answer from the same split, preferably of the same
kind, drawn by a seeded shuffle; answers are unique after de-duplication, so it never equals ``chosen``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
import tokenize
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import UserError

KINDS = ("module", "class", "function", "method")
SKIP_REASONS = ("local", "private_name", "no_docstring", "uninformative", "too_long", "duplicate_docstring")
MIN_ANSWER_WORDS = 2
SPLITS = ("train", "val")
DEFAULT_MAX_LEN_CHARS = 600
DEFAULT_VAL_FRACTION = 0.1
MODULE_NAMES_SHOWN = 6  # public names in a module's input line
DEFAULT_SHOWN_CHARS = 16  # a longer default value is shown as ...

TEMPLATES: dict[str, tuple[str, ...]] = {
    "module": (
        "What does the module `{module}` do?",
        "What is the Python module `{module}` for?",
        "Describe the purpose of the `{module}` module.",
    ),
    "class": (
        "What does the class `{name}` in module `{module}` do?",
        "What is `{module}.{name}` for?",
        "Describe the class `{name}` defined in `{module}`.",
    ),
    "function": (
        "What does the function `{name}` in module `{module}` do?",
        "Explain what `{module}.{name}()` does.",
        "In the module `{module}`, what is the function `{name}` for?",
    ),
    "method": (
        "What does the method `{owner}.{name}` in module `{module}` do?",
        "Explain the `{name}` method of `{owner}` (module `{module}`).",
        "What is `{module}.{owner}.{name}()` for?",
    ),
}


@dataclass(frozen=True)
class Found:
    """One object met in a file: its module, dotted name within it (empty for the module), kind and the
    raw facts the record is made of. ``kind`` is ``local`` for a definition inside a function."""

    module: str
    qualname: str
    kind: str
    node: ast.AST
    docstring: str | None


@dataclass(frozen=True)
class Pair:
    """A kept object: its question (instruction + input) and answer."""

    module: str
    qualname: str
    kind: str
    instruction: str
    input: str
    output: str

    @property
    def prompt(self) -> str:
        """The question as one text: the DPO prompt, and the instruction + input of the SFT record."""
        return f"{self.instruction}\n\n{self.input}"


@dataclass
class Built:
    pairs: dict[str, list[Pair]]  # split -> kept objects in file and source order
    skipped: dict[str, Counter]  # reason -> count per kind
    found: Counter  # kind (incl. local) -> objects met
    modules: dict[str, list[str]]  # split -> modules with at least one kept object, sorted
    read: dict[str, int]  # split -> modules read (files)
    files: int
    unparsable: list[str]  # files that could not be read or parsed (the corpus skips them too)


def module_name(rel: str) -> str:
    """Dotted module name of a path relative to the standard library (as the pystdlib corpus names it)."""
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def held_out(module: str, seed: int, val_fraction: float) -> bool:
    """Whether ``module`` goes to validation: ``u = int(sha256(f"{seed}:{module}")[:8 bytes]) / 2**64``,
    held out when ``u < val_fraction`` (about that share of modules, the same ones for a seed)."""
    digest = hashlib.sha256(f"{seed}:{module}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def first_paragraph(docstring: str) -> str:
    """The docstring (already dedented by ``ast.get_docstring``) up to its first blank line, with runs of
    whitespace collapsed to one space."""
    para = re.split(r"\n\s*\n", docstring.strip(), maxsplit=1)[0]
    return " ".join(para.split())


def uninformative(answer: str, found: Found) -> bool:
    """An answer of fewer than ``MIN_ANSWER_WORDS`` words (``"Constructor."``, ``"¶"``), or one that only
    repeats the object's name (a module docstring ``"distutils.cmd"``)."""
    if len(answer.split()) < MIN_ANSWER_WORDS:
        return True
    bare = answer.strip(" .:`'\"")
    return bare in (found.module, found.qualname, f"{found.module}.{found.qualname}")


def is_private(module: str, qualname: str) -> bool:
    """A part of the dotted name starts with ``_`` and is not a dunder (``__init__`` is public)."""
    parts = module.split(".") + (qualname.split(".") if qualname else [])
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def walk(tree: ast.Module, module: str) -> Iterator[Found]:
    """The module and every class and function definition in it, in source order, also those under
    ``if`` / ``try`` / ``with`` blocks; a definition inside a function (and all under it) is ``local``."""
    yield Found(module, "", "module", tree, ast.get_docstring(tree))

    def visit(body: list[ast.stmt], prefix: str, scope: str) -> Iterator[Found]:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{stmt.name}"
                is_class = isinstance(stmt, ast.ClassDef)
                if scope == "function":
                    kind = "local"
                elif is_class:
                    kind = "class"
                else:
                    kind = "method" if scope == "class" else "function"
                yield Found(module, name, kind, stmt, ast.get_docstring(stmt))
                inner = "function" if scope == "function" or not is_class else "class"
                yield from visit(stmt.body, f"{name}.", inner)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for child in getattr(stmt, field, None) or []:
                        sub = child.body if isinstance(child, ast.excepthandler | ast.match_case) else [child]
                        yield from visit(sub, prefix, scope)

    yield from visit(tree.body, "", "module")


def _short(node: ast.expr) -> str:
    text = ast.unparse(node)
    return text if len(text) <= DEFAULT_SHOWN_CHARS else "..."


def signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``def name(args) -> ret``, with default values longer than a few characters shown as ``...``."""
    args = node.args
    shown = ast.arguments(
        posonlyargs=args.posonlyargs,
        args=args.args,
        vararg=args.vararg,
        kwonlyargs=args.kwonlyargs,
        kw_defaults=[d if d is None else ast.Name(_short(d)) for d in args.kw_defaults],
        kwarg=args.kwarg,
        defaults=[ast.Name(_short(d)) for d in args.defaults],
    )
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    ret = f" -> {_short(node.returns)}" if node.returns is not None else ""
    return f"{keyword} {node.name}({ast.unparse(shown)}){ret}"


def code_input(found: Found) -> str:
    """The short code excerpt shown with the question: the signature line (a method under its class line,
    a class with its ``__init__``), or for a module ``from M import`` its first public names."""
    node = found.node
    if found.kind == "module":
        assert isinstance(node, ast.Module)
        names = [
            s.name
            for s in node.body
            if isinstance(s, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and not s.name.startswith("_")
        ]
        if not names:
            return f"import {found.module}"
        more = ", ..." if len(names) > MODULE_NAMES_SHOWN else ""
        return f"from {found.module} import {', '.join(names[:MODULE_NAMES_SHOWN])}{more}"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(_short(b) for b in node.bases)
        line = f"class {node.name}({bases}):" if bases else f"class {node.name}:"
        init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        return f"{line}\n    {signature(init)}" if init is not None else line
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    if found.kind == "method":
        owner = found.qualname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        return f"class {owner}:\n    {signature(node)}"
    return signature(node)


def instruction(found: Found, seed: int) -> str:
    """The question, in one of the kind's phrasings picked by a seeded hash of the object's name."""
    templates = TEMPLATES[found.kind]
    key = hashlib.sha256(f"{seed}:{found.module}:{found.qualname}".encode()).digest()
    template = templates[int.from_bytes(key[:4], "big") % len(templates)]
    parts = found.qualname.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    return template.format(module=found.module, name=parts[-1], owner=owner)


def parse_file(path: Path, root: Path) -> tuple[str, ast.Module] | None:
    """``(module name, tree)`` of a source file, None where it cannot be read or parsed."""
    try:
        with tokenize.open(path) as fh:  # honours PEP 263 encoding declarations
            source = fh.read()
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None
    return module_name(path.relative_to(root).as_posix()), tree


def check_args(val_fraction: float, max_len_chars: int) -> None:
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction: {val_fraction} is out of range; give a share of modules in (0, 1)")
    if max_len_chars < 1:
        raise UserError(f"--max-len-chars: {max_len_chars} is out of range; give at least 1 character")


def build(files: list[Path], root: Path, seed: int, val_fraction: float, max_len_chars: int) -> Built:
    """Walk ``files`` (sorted, under ``root``) and sort every object into a split or a skip reason."""
    check_args(val_fraction, max_len_chars)
    pairs: dict[str, list[Pair]] = {s: [] for s in SPLITS}
    skipped: dict[str, Counter] = {r: Counter() for r in SKIP_REASONS}
    found_kinds: Counter = Counter()
    modules: dict[str, set[str]] = {s: set() for s in SPLITS}
    seen: set[str] = set()
    read: Counter = Counter()
    unreadable: list[str] = []
    for path in files:
        parsed = parse_file(path, root)
        if parsed is None:
            unreadable.append(path.relative_to(root).as_posix())
            continue
        module, tree = parsed
        split = "val" if held_out(module, seed, val_fraction) else "train"
        read[split] += 1
        for f in walk(tree, module):
            found_kinds[f.kind] += 1
            reason, pair = _judge(f, seed, max_len_chars, seen)
            if reason is not None:
                skipped[reason][f.kind] += 1
                continue
            assert pair is not None
            seen.add(pair.output)
            pairs[split].append(pair)
            modules[split].add(module)
    return Built(
        pairs,
        skipped,
        found_kinds,
        {s: sorted(m) for s, m in modules.items()},
        dict(read),
        len(files),
        unreadable,
    )


def _judge(f: Found, seed: int, max_len_chars: int, seen: set[str]) -> tuple[str | None, Pair | None]:
    if f.kind == "local":
        return "local", None
    if is_private(f.module, f.qualname):
        return "private_name", None
    answer = first_paragraph(f.docstring or "")
    if not answer:
        return "no_docstring", None
    if uninformative(answer, f):
        return "uninformative", None
    pair = Pair(f.module, f.qualname, f.kind, instruction(f, seed), code_input(f), answer)
    if len(pair.instruction) + len(pair.input) + len(pair.output) > max_len_chars:
        return "too_long", None
    if answer in seen:
        return "duplicate_docstring", None
    return None, pair


def rejected_answers(pairs: list[Pair], seed: int) -> list[str]:
    """For each pair, another pair's answer: the pairs of one kind are shuffled (seeded) and each takes the
    next one's answer in that cycle; a kind with a single pair borrows from the whole split's cycle.
    Answers are unique, so each differs from its own. Needs at least two pairs."""
    if len(pairs) < 2:
        raise UserError(
            f"--val-fraction: a split has {len(pairs)} question(s); DPO needs at least 2 per split"
        )
    out: list[str | None] = [None] * len(pairs)

    def cycle(indices: list[int], salt: str) -> None:
        order = sorted(indices)
        random.Random(f"{seed}:{salt}").shuffle(order)
        for k, i in enumerate(order):
            out[i] = pairs[order[(k + 1) % len(order)]].output

    by_kind: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        by_kind.setdefault(p.kind, []).append(i)
    for kind, indices in by_kind.items():
        if len(indices) > 1:
            cycle(indices, kind)
    lone = [i for i in range(len(pairs)) if out[i] is None]  # kinds with one pair in the split
    if len(lone) == 1:
        lone.append(0 if lone[0] else 1)  # a second index to cycle with (its answer is rewritten)
    if lone:
        cycle(lone, "lone")
    return [r for r in out if r is not None]


def stats(built: Built, seed: int, val_fraction: float, max_len_chars: int) -> dict:
    """Counts per split and kind, modules per split and the skipped objects per reason and kind; the
    kept and skipped objects add up to ``objects.found``."""
    kept = {s: Counter(p.kind for p in built.pairs[s]) for s in SPLITS}
    return {
        "seed": seed,
        "val_fraction": val_fraction,
        "max_len_chars": max_len_chars,
        "python": sys.version.split()[0],
        "files": built.files,
        "files_unparsable": built.unparsable,
        "objects": {
            "found": sum(built.found.values()),
            "found_by_kind": {k: built.found[k] for k in (*KINDS, "local")},
            "kept": sum(len(built.pairs[s]) for s in SPLITS),
            "skipped": {r: sum(c.values()) for r, c in built.skipped.items()},
            "skipped_by_kind": {
                r: {k: c[k] for k in (*KINDS, "local") if c[k]} for r, c in built.skipped.items()
            },
        },
        "splits": {
            s: {
                "modules": len(built.modules[s]),
                "modules_read": built.read.get(s, 0),
                "sft": len(built.pairs[s]),
                "dpo": len(built.pairs[s]),
                "by_kind": {k: kept[s][k] for k in KINDS},
            }
            for s in SPLITS
        },
        "modules": built.modules,
    }


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tmp.replace(path)


def write(built: Built, out: Path, seed: int, val_fraction: float, max_len_chars: int) -> dict:
    """``sft_{split}.jsonl``, ``dpo_{split}.jsonl`` and ``stats.json`` under ``out``; returns the stats."""
    rejected = {s: rejected_answers(built.pairs[s], seed) for s in SPLITS}  # before writing anything
    out.mkdir(parents=True, exist_ok=True)
    for s in SPLITS:
        sft = [{"instruction": p.instruction, "input": p.input, "output": p.output} for p in built.pairs[s]]
        dpo = [
            {"prompt": p.prompt, "chosen": p.output, "rejected": r}
            for p, r in zip(built.pairs[s], rejected[s], strict=True)
        ]
        _write_jsonl(out / f"sft_{s}.jsonl", sft)
        _write_jsonl(out / f"dpo_{s}.jsonl", dpo)
    summary = stats(built, seed, val_fraction, max_len_chars)
    (out / "stats.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stdlib_pairs(
    out: str | Path,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_len_chars: int = DEFAULT_MAX_LEN_CHARS,
    files: list[Path] | None = None,
    root: Path | None = None,
) -> dict:
    """``lmforge data stdlib-pairs``: the records of the files the default pretraining run read (or
    ``files`` under ``root``), written to ``out``; returns the stats."""
    from lmforge.corpus.pystdlib import stdlib_files, stdlib_root

    check_args(val_fraction, max_len_chars)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {out} is a file; give a folder (new or to overwrite)")
    root = stdlib_root() if root is None else root
    files = stdlib_files(include_tests=False) if files is None else files
    built = build(files, root, seed, val_fraction, max_len_chars)
    return write(built, out, seed, val_fraction, max_len_chars)
