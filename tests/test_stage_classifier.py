"""The ``classifier`` stage: the model's P(positive) in meta, removal below the threshold with value and
threshold, the strictness knob, a missing or damaged model stopping ``lmforge data`` (exit 2) before any
work, and a whole ``lmforge data`` run chaining ``classifier`` and ``blocklist``."""

from __future__ import annotations

import json

import pytest

from lmforge.cli import main
from lmforge.corpus import readers
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.quality_model import train_quality_model
from lmforge.corpus.stages.classifier import Classifier, ClassifierParams
from lmforge.corpus.stages.registry import stage_class
from lmforge.errors import ConfigError
from tests.test_quality_model import make_texts


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    model, _ = train_quality_model(make_texts("prose", 30, 0), make_texts("spam", 30, 1), seed=0)
    path = tmp_path_factory.mktemp("model") / "quality.npz"
    model.save(path)
    return path


def test_scores_in_meta_and_removes_below_threshold(model_path):
    stage = Classifier(ClassifierParams(model=str(model_path)))
    good = stage.process(Doc("g", make_texts("prose", 1, 5)[0], "default", meta={"x": 1}))
    assert isinstance(good, Doc) and good.meta["x"] == 1 and 0.5 <= good.meta["quality_score"] <= 1.0
    bad = stage.process(Doc("b", make_texts("spam", 1, 6)[0], "default"))
    assert isinstance(bad, Drop) and bad.reason == "classifier.low_score"
    assert bad.threshold == 0.5 and 0.0 <= bad.value < 0.5

    lenient = Classifier(ClassifierParams(model=str(model_path), threshold=0.0, meta_key="edu"))
    kept = lenient.process(Doc("b", make_texts("spam", 1, 6)[0], "default"))
    assert isinstance(kept, Doc) and kept.meta["edu"] == bad.value


def test_registered_with_a_strictness_knob():
    cls = stage_class("classifier")
    assert cls is Classifier and cls.filters
    (knob,) = cls.strictness
    assert (knob.param, knob.value(0), knob.value(50), knob.value(100)) == ("threshold", 0.0, 0.45, 0.9)


def test_missing_or_damaged_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"classifier\.model: .*nope\.npz: no such model file"):
        Classifier(ClassifierParams(model=str(tmp_path / "nope.npz")))
    (tmp_path / "bad.npz").write_text("{}")
    with pytest.raises(ConfigError, match=r"classifier\.model: .*bad\.npz: not a quality model file"):
        Classifier(ClassifierParams(model=str(tmp_path / "bad.npz")))


def _recipe(tmp_path, source, model, words_file) -> object:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[[sources]]\npath = "{source}"\n'
        f'[[stages]]\nname = "classifier"\nmodel = "{model}"\nthreshold = 0.5\n'
        f'[[stages]]\nname = "blocklist"\nwords_file = "{words_file}"\nuse_default_list = false\n'
        '[output]\ncompression = "none"\n[execution]\nworkers = 1\n'
    )
    return recipe


def _records(folder):
    return [r for p in sorted(folder.glob("*.jsonl*")) for r in readers.json_records(p)]


def test_data_run_with_classifier_and_blocklist(tmp_path, model_path, cli_logging):
    prose, spam = make_texts("prose", 6, 20), make_texts("spam", 4, 21)
    prose[0] += " The delta is full of gravel and grit."  # a listed phrase across a line break below
    prose[0] = prose[0].replace("full of gravel", "full of\ngravel")
    docs = [{"id": f"p{i}", "text": t} for i, t in enumerate(prose)] + [
        {"id": f"s{i}", "text": t} for i, t in enumerate(spam)
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    words = tmp_path / "words.txt"
    words.write_text("# test list\nfull of gravel\n")
    recipe = _recipe(tmp_path, src, model_path, words)
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--config", str(recipe), "--out", str(tmp_path / "out"), "--no-tokenize"])
    assert exit_.value.code == 0
    kept = {r["id"]: r for r in _records(tmp_path / "out" / "kept")}
    removed = {r["id"]: r for r in _records(tmp_path / "out" / "removed")}
    assert set(kept) == {f"p{i}" for i in range(1, 6)}
    assert all(
        r["meta"]["quality_score"] >= 0.5 and r["meta"]["blocklist_matches"] == 0 for r in kept.values()
    )
    assert removed["p0"]["reason"] == "blocklist.listed_word" and removed["p0"]["value"] == "full of gravel"
    assert {removed[f"s{i}"]["reason"] for i in range(4)} == {"classifier.low_score"}
    assert all(removed[f"s{i}"]["value"] < 0.5 and removed[f"s{i}"]["threshold"] == 0.5 for i in range(4))


def test_data_run_with_a_missing_model_exits_2_before_any_work(tmp_path, model_path, capsys, cli_logging):
    """Every stage is built before OUT is written: nothing is there after the error, and the same command
    runs once the model is there."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "some text"}\n')
    words = tmp_path / "words.txt"
    words.write_text("word\n")
    recipe = _recipe(tmp_path, src, tmp_path / "missing.npz", words)
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--config", str(recipe), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "classifier.model" in err and "missing.npz" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "missing.npz").write_bytes(model_path.read_bytes())
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--config", str(recipe), "--out", str(tmp_path / "out"), "--no-tokenize"])
    assert exit_.value.code == 0
