"""A failed ``lmforge sft`` / ``dpo`` start writes nothing: the records are read and checked before the
run folder gets its tokenizer, chat template or checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.recipe import load_config
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

USER = {"role": "user", "content": "What does read do?"}
BAD_INPUTS = {
    # garbage and binary lines: neither is a JSON record
    "garbage": ("sft", b"{not json\n\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\n", "not JSON"),
    "no_rejected": (
        "dpo",
        (json.dumps({"prompt": "What does read do?", "chosen": "It reads."}) + "\n").encode(),
        "missing field rejected",
    ),
    "empty": ("sft", b"", "is empty (no JSONL record)"),
    "no_assistant": (
        "sft",
        (json.dumps({"messages": [USER]}) + "\n").encode(),
        "no assistant turn in field messages",
    ),
}


@pytest.fixture(scope="module")
def pretrained(corpus_dir, tmp_path_factory) -> Path:
    """A tiny pretrained run (10 steps of the tiny recipe)."""
    root = tmp_path_factory.mktemp("pre")
    over = tiny_overrides(corpus_dir, root / "data") | {
        "train.sample_tokens": 0,
        "train.steps": 10,
        "train.eval_interval": 0,
    }
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("folder", ["new", "existing_empty"])
def test_a_start_with_bad_records_writes_nothing(pretrained, tmp_path, capsys, cli_logging, case, folder):
    kind, content, reason = BAD_INPUTS[case]
    records = tmp_path / "records.jsonl"
    records.write_bytes(content)
    run = tmp_path / "out"
    if folder == "existing_empty":
        run.mkdir()
    argv = [kind, "--from", str(pretrained), "--run-dir", str(run), f'--posttrain.train_files=["{records}"]']
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith(f"lmforge {kind}: error: posttrain.train_files: "), err
    assert str(records) in err and reason in err, err
    if folder == "new":
        assert not run.exists(), sorted(p.name for p in run.iterdir())
    else:
        assert list(run.iterdir()) == []
