"""``execution.max_error_fraction``: stage errors are removals up to the budget; past it the run stops
with one line, and the same command continues correctly once the stage is fixed.

The failing stages are real stages registered in the stage registry for the test. They raise on
documents containing "boom" while a file the test controls exists, so "fixing" the stage does not change
the configuration (whose fingerprint guards the output folder). The budget is checked over whole passes,
so its outcome does not depend on the worker count; these tests run inline (one worker) because the
registration is made in this process only.
"""

from __future__ import annotations

import inspect
import json
import tomllib
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from lmforge.cli import main
from lmforge.corpus import readers
from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.pipeline import StageErrorBudget, allowed_errors, run_pipeline
from lmforge.corpus.stages import registry
from lmforge.corpus.stages.base import CorpusStage, DocStage, StageParams
from lmforge.errors import ConfigError

WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "music",
    "market",
    "winter",
    "letter",
    "bridge",
    "forest",
    "silver",
    "paper",
]


class FlakyParams(StageParams):
    broken: str  # while a file exists at this path, the stage raises on documents containing "boom"


class Flaky(DocStage):
    """A per-document stage with a bug on some documents."""

    name: ClassVar[str] = "flaky"
    Params: ClassVar[type[StageParams]] = FlakyParams

    def process(self, doc: Doc) -> Doc | Drop:
        assert isinstance(self.params, FlakyParams)
        if "boom" in doc.text and Path(self.params.broken).exists():
            raise ValueError(f"cannot handle {doc.id}\nsecond line of the message")
        doc.meta["flaky"] = True
        return doc


class FlakyCorpus(CorpusStage):
    """A corpus stage whose ``apply`` has the bug: keeps documents whose CRC32 is even, removes the rest."""

    name: ClassVar[str] = "flaky_corpus"
    Params: ClassVar[type[StageParams]] = FlakyParams

    def signature(self, doc: Doc) -> int:
        return zlib.crc32(doc.text.encode())

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        odd = sorted(doc.id for doc, sig in signatures if doc is not None and sig % 2)
        (workdir / "odd.json").write_text(json.dumps(odd))
        return {"odd": len(odd)}

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        assert isinstance(self.params, FlakyParams)
        if "boom" in doc.text and Path(self.params.broken).exists():
            raise ValueError(f"cannot handle {doc.id}")
        return self.drop("odd") if doc.id in json.loads((workdir / "odd.json").read_text()) else doc


def _raise_line(cls: type) -> int:
    """The line of the ``raise`` in ``cls``'s method that has the bug."""
    method = cls.process if issubclass(cls, DocStage) else cls.apply
    lines, start = inspect.getsourcelines(method)
    return start + next(i for i, line in enumerate(lines) if "raise ValueError" in line)


@pytest.fixture(autouse=True)
def _stages(monkeypatch):
    monkeypatch.setitem(registry.STAGES, "flaky", "tests.test_error_budget:Flaky")
    monkeypatch.setitem(registry.STAGES, "flaky_corpus", "tests.test_error_budget:FlakyCorpus")


def _corpus(path: Path, docs: int, booms: set[int], seed: int = 0) -> list[str]:
    """A JSONL file of ``docs`` distinct documents; those numbered in ``booms`` contain "boom"."""
    ids = []
    with path.open("w") as fh:
        for i in range(docs):
            words = [WORDS[(i * 7 + j * (seed + 3)) % len(WORDS)] for j in range(8 + i % 5)]
            text = f"document {i} " + " ".join(words) + (" boom" if i in booms else "")
            ids.append(f"d{seed}-{i}")
            fh.write(json.dumps({"id": ids[-1], "text": text}) + "\n")
    return ids


def _records(folder: Path) -> list[dict]:
    return [rec for path in sorted(folder.glob("*.jsonl*")) for rec in readers.json_records(path)]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file of OUT but the work folder's (kept/, removed/, report.json), by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "work"
    }


def _recipe(tmp_path: Path, stages: str, fraction: float) -> Path:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[[sources]]\npath = "{tmp_path / "web.jsonl"}"\ndomain = "web"\n'
        f'[[sources]]\npath = "{tmp_path / "code.jsonl"}"\ndomain = "code"\n'
        f"{stages}[execution]\nchunk_bytes = 4096\nmax_error_fraction = {fraction}\n"
    )
    return recipe


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _flaky(tmp_path: Path, name: str = "flaky") -> str:
    return f'[[stages]]\nname = "{name}"\ndomains = ["web"]\nbroken = "{tmp_path / "broken"}"\n'


def test_allowed_errors_is_the_floor_of_the_share():
    assert allowed_errors(0.001, 999) == 0 and allowed_errors(0.001, 1000) == 1
    assert allowed_errors(0.29, 100) == 29  # 0.29 * 100 is 28.999... in floating point
    assert allowed_errors(0.0, 10**6) == 0 and allowed_errors(1.0, 7) == 7
    with pytest.raises(ConfigError, match=r"execution\.max_error_fraction"):
        build_pipeline_config({"sources": [{"path": "x"}], "execution": {"max_error_fraction": 1.5}})


def test_errors_within_the_budget_are_removals_counted_in_the_report(tmp_path):
    booms = {17, 123, 240, 399}  # 4 of 400 web documents: exactly 1 % allowed
    ids = _corpus(tmp_path / "web.jsonl", 400, booms)
    _corpus(tmp_path / "code.jsonl", 100, set(range(100)), seed=1)  # "boom" everywhere, not in domain
    (tmp_path / "broken").touch()
    recipe = _recipe(tmp_path, _flaky(tmp_path), 0.01)
    report = run_pipeline(build_pipeline_config(_toml(recipe)), tmp_path / "out", workers=1)
    assert report["shards"] > 3
    errors = [r for r in _records(tmp_path / "out" / "removed") if r["reason"] == "flaky.error"]
    assert sorted(r["id"] for r in errors) == sorted(ids[i] for i in booms)
    row = next(s for s in report["stages"] if s["stage"] == "flaky")
    assert row["removed"] == {"flaky.error": 4} and report["removed"]["flaky.error"] == 4
    assert row["docs_in"] == 500  # code documents pass through it ...
    first = {
        "file": __file__,
        "line": _raise_line(Flaky),
        "error": f"ValueError: cannot handle {ids[17]} second line of the message",
        "doc": ids[17],
    }
    assert row["errors"] == {"documents": 400, "count": 4, "first": first}  # ... but are not given to it
    assert next(s for s in report["stages"] if s["stage"] == "read")["removed"] == {}
    assert not (tmp_path / "out" / "work" / "redo.json").exists()


@pytest.mark.usefixtures("cli_logging")
def test_over_the_budget_the_cli_stops_with_one_line(tmp_path, capsys):
    booms = {17, 123, 240, 300, 399}  # 5 of 400: one more than 1 % allows
    ids = _corpus(tmp_path / "web.jsonl", 400, booms)
    _corpus(tmp_path / "code.jsonl", 100, set(), seed=1)
    (tmp_path / "broken").touch()
    recipe = _recipe(tmp_path, _flaky(tmp_path), 0.01)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--config", str(recipe), "--out", str(out), "--workers", "1", "--no-tokenize"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("lmforge data: error:")]
    assert "stage flaky: 5 of the 400 documents" in line and "max_error_fraction = 0.01 (4 allowed)" in line
    assert (
        f"first at {__file__}:{_raise_line(Flaky)} on document {ids[17]}: ValueError: cannot handle" in line
    )
    assert not (out / "report.json").exists() and not list((out / "work" / "pass-0").glob("*.done"))
    with pytest.raises(StageErrorBudget, match="stage flaky: 5 of"):  # the same again: nothing was kept
        run_pipeline(build_pipeline_config(_toml(recipe)), out, workers=1)


@pytest.mark.usefixtures("cli_logging")
@pytest.mark.parametrize(
    ("stage", "redone"),
    [("flaky", [1]), ("flaky_corpus", [1, 2])],  # a corpus stage's work starts in its signature pass
    ids=["doc_stage", "corpus_stage_apply"],
)
def test_fixed_stage_resumes_to_the_clean_output(tmp_path, stage, redone):
    booms = {3, 50, 51, 52, 140, 299}
    _corpus(tmp_path / "web.jsonl", 300, booms)
    _corpus(tmp_path / "code.jsonl", 60, set(), seed=1)
    stages = '[[stages]]\nname = "length"\nmin_words = 9\n[[stages]]\nname = "dedup_exact"\n'
    recipe = _recipe(tmp_path, stages + _flaky(tmp_path, stage), 0.01)
    command = ["data", "--config", str(recipe), "--workers", "1", "--no-tokenize", "--out"]

    def run(out: Path) -> int:
        with pytest.raises(SystemExit) as exit_:
            main([*command, str(out)])
        return exit_.value.code

    assert run(tmp_path / "clean") == 0  # the stage is fine while the file is absent
    (tmp_path / "broken").touch()
    out = tmp_path / "out"
    assert run(out) == 2
    work = out / "work"
    assert not (work / "redo.json").exists() and not (out / "report.json").exists()
    for k in redone:  # the failing stage's work is forgotten (files it wrote stay, unmarked)
        assert not list((work / f"pass-{k}").glob("*.done"))
    assert list((out / "kept").iterdir())
    plans = sorted(p.parent.name for p in work.glob("corpus-*/plan.done"))
    assert plans == ["corpus-0"]  # dedup_exact's plan is kept; flaky_corpus's (corpus-1) is redone
    before = {p: p.stat().st_mtime_ns for p in (work / "pass-0").glob("*.done")}
    assert len(before) > 3

    (tmp_path / "broken").unlink()  # the fix
    assert run(out) == 0
    assert {p: p.stat().st_mtime_ns for p in (work / "pass-0").glob("*.done")} == before  # reused
    assert _tree(out) == _tree(tmp_path / "clean")
    report = json.loads((out / "report.json").read_text())
    assert next(s for s in report["stages"] if s["stage"] == stage)["errors"]["count"] == 0


def test_finished_run_checked_against_a_stricter_budget_is_redone_from_the_input(tmp_path):
    _corpus(tmp_path / "web.jsonl", 300, {7, 8})
    _corpus(tmp_path / "code.jsonl", 60, set(), seed=1)
    (tmp_path / "broken").touch()
    stages = '[[stages]]\nname = "dedup_exact"\n' + _flaky(tmp_path)
    tree = _toml(_recipe(tmp_path, stages, 0.01))
    out = tmp_path / "out"
    report = run_pipeline(build_pipeline_config(tree), out, workers=1)  # 2 errors of 300 allowed
    finished = _tree(out)
    tree["execution"]["max_error_fraction"] = 0.0  # not part of the fingerprint: the same OUT
    with pytest.raises(StageErrorBudget, match="stage flaky: 2 of the 300"):
        run_pipeline(build_pipeline_config(tree), out, workers=1)
    assert not list((out / "work").glob("pass-*/*.done")) and not (out / "report.json").exists()
    tree["execution"]["max_error_fraction"] = 0.01  # intermediate files were spent: redone from pass 0
    assert run_pipeline(build_pipeline_config(tree), out, workers=1) == report
    assert _tree(out) == finished
