"""``lmforge data stdlib-pairs``: the post-training demonstration's questions about the standard library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.corpus.pystdlib import stdlib_files, stdlib_root
from lmforge.errors import UserError
from lmforge.posttrain.stdlib_pairs import (
    KINDS,
    SKIP_REASONS,
    Pair,
    build,
    first_paragraph,
    held_out,
    rejected_answers,
    stdlib_pairs,
)

ALPHA = (
    '''"""Alpha tools for the tests.

A second paragraph that is not part of the answer.
"""

def add(a, b=1, *rest, key=("a very long default value",), **kw) -> int:
    """Add two numbers
       and return   the sum.

    Details nobody asked for.
    """

def _hidden():
    """A private helper function."""

def bare():
    pass

class Box(Base):
    """A box of things."""

    def __init__(self, size):
        """Make a box of the given size."""

    def open(self):
        """Open the lid of the box."""

    def again(self):
        """Add two numbers and return the sum."""

    def _peek(self):
        """Look inside without opening."""

def outer():
    """Outer function with a helper."""
    def inner():
        """Inner helper, local to outer."""
    class Local:
        """A class local to outer."""
        def method(self):
            """A method of a local class."""

def tiny():
    """Tiny."""

def wordy():
    """'''
    + "word " * 200
    + '''"""

if True:
    async def guarded(x):
        """Defined under an if block."""
'''
)


def _module(i: int) -> str:
    return "".join(
        f'def f{j}(x):\n    """Function {j} of module {i}, which does thing {i * 10 + j}."""\n\n'
        for j in range(3)
    )


@pytest.fixture
def tiny_stdlib(tmp_path: Path) -> tuple[list[Path], Path]:
    """alpha.py (every case once), an empty package ``pkg`` and 12 modules of 3 documented functions."""
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "alpha.py").write_text(ALPHA)
    (root / "pkg" / "__init__.py").write_text("")
    for i in range(12):
        (root / "pkg" / f"m{i:02d}.py").write_text(_module(i))
    return sorted(root.rglob("*.py")), root


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_object_is_kept_once_or_skipped_for_one_reason(tiny_stdlib):
    files, root = tiny_stdlib
    built = build(files, root, seed=0, val_fraction=0.3, max_len_chars=600)
    skipped = {r: dict(c) for r, c in built.skipped.items() if c}
    assert skipped == {
        "local": {"local": 3},  # inner, Local, Local.method: all under outer
        "private_name": {"function": 1, "method": 1},  # _hidden, Box._peek
        "no_docstring": {"function": 1, "module": 13},  # bare; pkg/__init__.py and the 12 pkg.mNN
        "uninformative": {"function": 1},  # tiny: one word
        "too_long": {"function": 1},  # wordy
        "duplicate_docstring": {"method": 1},  # Box.again repeats add's answer
    }
    kept = {(p.module, p.qualname): p for s in ("train", "val") for p in built.pairs[s]}
    assert set(kept) >= {
        ("alpha", ""),
        ("alpha", "add"),
        ("alpha", "Box"),
        ("alpha", "Box.__init__"),
        ("alpha", "Box.open"),
        ("alpha", "outer"),
        ("alpha", "guarded"),
    }
    assert len(kept) == 7 + 12 * 3  # alpha's 7 and the 3 functions of each pkg.mNN
    found = sum(built.found.values())
    assert found == len(kept) + sum(sum(c.values()) for c in built.skipped.values())
    add, box, init, opened = (kept["alpha", n] for n in ("add", "Box", "Box.__init__", "Box.open"))
    assert add.output == "Add two numbers and return the sum."
    assert add.input == "def add(a, b=1, *rest, key=..., **kw) -> int"
    assert box.input == "class Box(Base):\n    def __init__(self, size)" and box.kind == "class"
    assert init.kind == "method" and opened.input == "class Box:\n    def open(self)"
    assert kept["alpha", "guarded"].input == "async def guarded(x)"
    assert kept["alpha", ""].output == "Alpha tools for the tests."
    assert kept["alpha", ""].input == "from alpha import add, bare, Box, outer, tiny, wordy"


def test_first_paragraph_dedents_and_collapses_whitespace():
    assert first_paragraph("  One\n\t two   three.\n   \n Rest.") == "One two three."
    assert first_paragraph("") == ""


def test_whole_modules_go_to_one_split_by_seeded_hash(tiny_stdlib):
    files, root = tiny_stdlib
    built = build(files, root, seed=0, val_fraction=0.3, max_len_chars=600)
    assert built.pairs["train"] and built.pairs["val"]
    by_split = {s: {p.module for p in built.pairs[s]} for s in ("train", "val")}
    assert not by_split["train"] & by_split["val"]
    for s, pairs in built.pairs.items():
        assert all(held_out(p.module, 0, 0.3) == (s == "val") for p in pairs)
    other = build(files, root, seed=1, val_fraction=0.3, max_len_chars=600)
    assert {p.module for p in other.pairs["val"]} != by_split["val"]  # the seed moves the split


def test_rejected_is_another_answer_of_the_split_even_for_a_lone_kind():
    pairs = [Pair("m", f"f{i}", "function", "q", "def f()", f"answer {i}") for i in range(4)]
    pairs.append(Pair("m", "", "module", "q", "import m", "the module's answer"))
    for seed in range(5):
        rejected = rejected_answers(pairs, seed)
        assert len(rejected) == len(pairs)
        assert all(r != p.output for p, r in zip(pairs, rejected, strict=True))
        assert set(rejected) <= {p.output for p in pairs}
    assert rejected_answers(pairs, 3) == rejected_answers(pairs, 3)
    with pytest.raises(UserError, match="at least 2"):
        rejected_answers(pairs[:1], 0)


def test_output_is_the_same_for_a_seed_and_changes_with_it(tiny_stdlib, tmp_path):
    files, root = tiny_stdlib
    names = ("sft_train.jsonl", "sft_val.jsonl", "dpo_train.jsonl", "dpo_val.jsonl", "stats.json")
    out = {}
    for key, seed in (("a", 7), ("b", 7), ("c", 8)):
        stdlib_pairs(tmp_path / key, seed, 0.3, 600, files=files, root=root)
        out[key] = [(tmp_path / key / n).read_bytes() for n in names]
    assert out["a"] == out["b"]
    assert out["a"] != out["c"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[Path, int]:
    """The command on this interpreter's standard library, once (about 6 s)."""
    out = tmp_path_factory.mktemp("pairs") / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["data", "stdlib-pairs", "--out", str(out), "--seed", "3"])
    return out, exit_.value.code


def test_command_writes_complete_records_from_the_pretraining_files(real_run, cli_logging):
    out, code = real_run
    assert code == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["files"] == len(stdlib_files(include_tests=False)) and not stats["files_unparsable"]
    objects, splits = stats["objects"], stats["splits"]
    assert set(objects["skipped"]) == set(SKIP_REASONS)
    assert objects["found"] == objects["kept"] + sum(objects["skipped"].values())
    assert objects["kept"] == sum(s["sft"] for s in splits.values())
    for reason, by_kind in objects["skipped_by_kind"].items():
        assert sum(by_kind.values()) == objects["skipped"][reason]
    for name, split in splits.items():
        sft, dpo = _lines(out / f"sft_{name}.jsonl"), _lines(out / f"dpo_{name}.jsonl")
        assert len(sft) == len(dpo) == split["sft"] == split["dpo"] == sum(split["by_kind"].values())
        assert all(split["by_kind"][k] > 0 for k in KINDS)
        for rec in sft:
            assert set(rec) == {"instruction", "input", "output"}
            assert all(isinstance(v, str) and v.strip() for v in rec.values())
            assert sum(map(len, rec.values())) <= stats["max_len_chars"]
        for rec, pair in zip(sft, dpo, strict=True):
            assert set(pair) == {"prompt", "chosen", "rejected"}
            assert all(isinstance(v, str) and v.strip() for v in pair.values())
            assert (
                pair["prompt"] == f"{rec['instruction']}\n\n{rec['input']}"
                and pair["chosen"] == rec["output"]
            )
            assert pair["rejected"] != pair["chosen"]
        answers = {r["output"] for r in sft}
        assert all(p["rejected"] in answers for p in dpo)  # from the same split
    train, val = (set(stats["modules"][s]) for s in ("train", "val"))
    assert train and val and not train & val
    assert all(held_out(m, 3, stats["val_fraction"]) for m in val)
    read = sum(s["modules_read"] for s in splits.values())
    # about 0.1: a hash per module; with a few hundred modules (the local Python's standard library) the
    # share's standard error is ~0.017, so +-0.05 is ~3 of them (the count depends on the Python, not the CPU)
    assert read == stats["files"] and 0.05 < splits["val"]["modules_read"] / read < 0.15
    questions = {s: {r["instruction"] for r in _lines(out / f"sft_{s}.jsonl")} for s in ("train", "val")}
    assert not questions["train"] & questions["val"]
    answers = {s: {r["output"] for r in _lines(out / f"sft_{s}.jsonl")} for s in ("train", "val")}
    assert not answers["train"] & answers["val"]  # duplicates were dropped before the split


def test_real_modules_land_in_the_split_of_their_hash():
    root = stdlib_root()
    files = [p for p in stdlib_files() if p.relative_to(root).parts[0] in ("json", "email", "asyncio")]
    built = build(files, root, seed=3, val_fraction=0.3, max_len_chars=600)
    for s, pairs in built.pairs.items():
        assert pairs and all(held_out(p.module, 3, 0.3) == (s == "val") for p in pairs)


@pytest.mark.parametrize(
    ("flag", "value"), [("--val-fraction", "1.5"), ("--val-fraction", "0"), ("--max-len-chars", "0")]
)
def test_bad_arguments_exit_2_with_one_line_naming_the_flag(tmp_path, capsys, cli_logging, flag, value):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["data", "stdlib-pairs", "--out", str(out), flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and flag in err
    assert not out.exists()  # refused before any work


def test_out_that_is_a_file_exits_2(tmp_path, capsys, cli_logging):
    out = tmp_path / "taken"
    out.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["data", "stdlib-pairs", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and "--out" in err
