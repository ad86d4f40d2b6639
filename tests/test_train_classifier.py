"""``lmforge data train-classifier``: a real run over jsonl, txt and parquet inputs (model, report,
printed figures, sampling), and bad input as one line with exit status 2 and nothing written."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.cli import main
from lmforge.corpus.quality_model import QualityModel
from lmforge.corpus.train_classifier import sample
from tests.test_quality_model import make_texts

pytestmark = pytest.mark.usefixtures("cli_logging")  # the CLI points lmforge's logger at stderr


def _inputs(tmp_path) -> None:
    """Positive: a JSONL file (with one malformed line) and a folder of .txt; negative: a parquet file."""
    pos = make_texts("prose", 30, 0)
    (tmp_path / "pos").mkdir()
    with (tmp_path / "pos" / "a.jsonl").open("w") as fh:
        fh.writelines(json.dumps({"body": t}) + "\n" for t in pos[:20])
        fh.write("{not json\n")
    for i, t in enumerate(pos[20:]):
        (tmp_path / "pos" / f"doc{i}.txt").write_text(t)
    neg = make_texts("spam", 25, 1)
    pq.write_table(pa.table({"body": neg}), tmp_path / "neg.parquet")


def _cli(*args: str) -> int:
    with pytest.raises(SystemExit) as exit_:
        main(["data", "train-classifier", *args])
    return exit_.value.code


def test_real_run_writes_model_and_report(tmp_path, capsys):
    _inputs(tmp_path)
    out = tmp_path / "models" / "q.npz"
    code = _cli("--positive", str(tmp_path / "pos"), "--negative", str(tmp_path / "*.parquet"),
                "--out", str(out), "--text-field", "body")  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((tmp_path / "models" / "q.report.json").read_text())
    assert report["classes"]["positive"] | {"sources": None} == {
        "sources": None, "files": 11, "bad_records": 1, "documents": 30, "sampled": 30,
    }  # fmt: skip
    assert report["classes"]["negative"]["documents"] == 25 and report["classes"]["negative"]["files"] == 1
    ho = report["held_out"]
    assert ho["n_test"] == 11 and ho["accuracy"] == 1.0
    assert "positive: 30 of 30 documents from 11 files, 1 bad records skipped" in printed
    assert (
        f"held out (11 documents, {ho['n_test_positive']} positive): accuracy 1.0000, AUC 1.0000" in printed
    )
    model = QualityModel.load(out)
    scores = model.score(make_texts("prose", 5, 40) + make_texts("spam", 5, 41))
    assert scores[:5].min() > 0.5 > scores[5:].max()

    # --max-docs: a seeded sample per class, the same on a second run
    again = tmp_path / "small.npz"
    args = ["--positive", str(tmp_path / "pos"), "--negative", str(tmp_path / "neg.parquet"), "--out", str(again),
            "--text-field", "body", "--max-docs", "8", "--seed", "3"]  # fmt: skip
    assert _cli(*args) == 0
    small = json.loads((tmp_path / "small.report.json").read_text())
    assert small["classes"]["positive"]["sampled"] == 8 and small["classes"]["positive"]["documents"] == 30
    first = QualityModel.load(again).weights
    assert _cli(*args) == 0
    assert np.array_equal(QualityModel.load(again).weights, first)


def test_reservoir_sample_is_uniform_and_seeded():
    texts = [str(i) for i in range(10)]
    counts = np.zeros(10)
    for seed in range(2000):
        kept, seen = sample(iter(texts), 3, random.Random(seed), 100)
        assert seen == 10 and len(set(kept)) == 3
        counts[[int(t) for t in kept]] += 1
    # each kept with probability 3/10: a binomial share of 2000 draws has standard error 0.010, so 0.05 is
    # 4.9 of them for each of the 10 (the seeds are Python's generator: the same draws on every machine)
    assert np.all(np.abs(counts / 2000 - 0.3) < 0.05)
    assert sample(iter(["abcdef"]), None, random.Random(0), 3) == (["abc"], 1)


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    _inputs(tmp_path)
    (tmp_path / "empty.jsonl").write_text('{"body": "   "}\n\n')
    (tmp_path / "folder.npz").mkdir()
    out = str(tmp_path / "m.npz")
    pos, neg = ["--positive", str(tmp_path / "pos")], ["--negative", str(tmp_path / "neg.parquet")]
    cases = [
        ([*pos, "--negative", str(tmp_path / "nothing*.jsonl"), "--out", out], "--negative: "),
        ([*pos, "--negative", str(tmp_path / "gone.jsonl"), "--out", out], "gone.jsonl does not exist"),
        ([*pos, "--negative", str(tmp_path / "empty.jsonl"), "--out", out], "--negative: "),
        ([*pos, *neg, "--out", str(tmp_path / "folder.npz")], "folder.npz is a folder"),
        ([*pos, "--negative", str(tmp_path / "pos" / "a.jsonl"), "--out", out], "both name"),
        ([*pos, "--negative", "builtin:pystdlib:docs", "--out", out], "unknown domain 'docs'"),
        ([*pos, "--negative", "builtin:nothere", "--out", out], "unknown built-in corpus"),
        ([*pos, *neg, "--out", out, "--max-docs", "1"], "--max-docs: 1"),
        ([*pos, *neg, "--out", out], "no column 'text'"),  # parquet without --text-field body
    ]
    for args, message in cases:
        code = _cli(*args, *(["--text-field", "body"] if "no column" not in message else []))
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
    assert not (tmp_path / "m.npz").exists() and not (tmp_path / "m.report.json").exists()
    assert not any((tmp_path / "folder.npz").iterdir())
