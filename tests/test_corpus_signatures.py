"""Batched signatures (``CorpusStage.signatures`` on groups of ``signature_batch`` documents): the pipeline's
output and error accounting are those of one ``signature`` call per document.

The test stage is registered for the test (as in ``test_error_budget.py``, so the runs are inline). Its
batched call fails as a whole when one document of the group is bad (as a model's forward pass would);
the pipeline then calls ``signature`` on each document of the group, so only the bad one is removed.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from lmforge.corpus import readers
from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.pipeline import run_pipeline
from lmforge.corpus.stages import registry
from lmforge.corpus.stages.base import CorpusStage, StageParams

CALLS: list[int] = []  # sizes of the groups the batched call was given, in this process


class CrcParams(StageParams):
    batch: int = 1


class Crc(CorpusStage):
    """Keeps documents whose CRC32 is even; raises on documents containing "boom"."""

    name: ClassVar[str] = "crc"
    Params: ClassVar[type[StageParams]] = CrcParams

    def __init__(self, params: StageParams | None = None):
        super().__init__(params)
        assert isinstance(self.params, CrcParams)
        self.signature_batch = self.params.batch

    def signature(self, doc: Doc) -> int:
        if "boom" in doc.text:
            raise ValueError(f"cannot sign {doc.id}")
        return zlib.crc32(doc.text.encode())

    def signatures(self, docs: list[Doc]) -> list[int]:
        CALLS.append(len(docs))
        if any("boom" in d.text for d in docs):
            raise RuntimeError("the whole group failed")
        return [zlib.crc32(d.text.encode()) for d in docs]

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        odd = sorted(doc.id for doc, sig in signatures if doc is not None and sig % 2)
        (workdir / "odd.json").write_text(json.dumps(odd))
        return {"odd": len(odd)}

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        return self.drop("odd") if doc.id in json.loads((workdir / "odd.json").read_text()) else doc


@pytest.fixture(autouse=True)
def _stage(monkeypatch):
    monkeypatch.setitem(registry.STAGES, "crc", "tests.test_corpus_signatures:Crc")
    CALLS.clear()


def _corpus(path: Path) -> None:
    """300 documents: every 7th too short for ``length`` (removed before the signature), five with "boom"
    (the signature fails)."""
    with path.open("w") as fh:
        for i in range(300):
            words = "x" if i % 7 == 0 else " ".join(f"w{(i * 13 + j) % 97}" for j in range(3 + i % 9))
            text = f"doc {i} {words}" + (" boom" if i in (5, 6, 100, 101, 299) else "")
            fh.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")


def _run(tmp_path: Path, batch: int) -> tuple[dict, dict[str, bytes]]:
    tree = {
        "sources": [{"path": str(tmp_path / "in.jsonl"), "domain": "web"}],
        "stages": [
            {"name": "length", "min_words": 4},
            {"name": "crc", "batch": batch},
        ],
        "execution": {"chunk_bytes": 4096, "max_error_fraction": 0.5},
        "tokenize": {"enabled": False},
    }
    out = tmp_path / f"out-{batch}"
    report = run_pipeline(build_pipeline_config(tree), out, workers=1)
    files = {
        str(p.relative_to(out)): p.read_bytes()
        for folder in ("kept", "removed")
        for p in sorted((out / folder).glob("*"))
    }
    return report, files


def test_batched_signatures_give_the_output_and_errors_of_single_ones(tmp_path):
    _corpus(tmp_path / "in.jsonl")
    one, one_files = _run(tmp_path, 1)
    assert CALLS == []  # a group of one is the plain signature call
    batched, batched_files = _run(tmp_path, 8)
    assert max(CALLS) == 8 and len(CALLS) > 10
    assert batched_files == one_files  # the same records in the same order
    assert {k: v for k, v in batched.items() if k != "fingerprint"} == {
        k: v for k, v in one.items() if k != "fingerprint"
    }
    row = next(s for s in batched["stages"] if s["stage"] == "crc")
    assert row["errors"]["count"] == 5 and row["errors"]["first"]["doc"] == "d5"
    assert row["errors"]["first"]["error"] == "ValueError: cannot sign d5"  # from signature, not the group
    removed = [
        r["reason"]
        for p in sorted((tmp_path / "out-8" / "removed").glob("*"))
        for r in readers.json_records(p)
    ]
    assert removed.count("crc.error") == 5 and removed.count("length.too_few_words") > 30
