"""The global batch a run starts with is part of the run: a resume keeps it (the accumulation absorbs
another micro-batch size or process count), refuses when it cannot be kept exactly, and changes it only
when ``--train.tokens_per_step`` says so, logged with the learning-rate rule. The resume in another
process count is ``tests/test_distributed.py::test_resume_in_one_process_keeps_the_global_batch``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.errors import ConfigError
from lmforge.recipe import load_config
from lmforge.train.build import accumulation_steps
from lmforge.train.callbacks.checkpointing import config_state
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.launch import train
from lmforge.train.resume import config_changes, global_batch, keep_global_batch, read_history
from tests.conftest import tiny_overrides


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def batch_tokens(run: Path) -> dict[int, int]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["batch_tokens"] for x in lines if "batch_tokens" in x}


@pytest.fixture
def stopped_run(corpus_dir, tmp_path) -> Path:
    """A tiny run of 4 sequences of 32 tokens per step (train.tokens_per_step unset), stopped at step 10."""
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.sample_tokens": 0,
        "train.eval_interval": 0,
    }
    run = tmp_path / "run"
    train(load_config(None, over), run, progress_bar=False, callbacks=[StopAfter(10)])
    return run


def test_the_global_batch_of_a_checkpoint_and_the_accumulation_that_keeps_it(corpus_dir, tmp_path):
    """Trained by 2 data-parallel ranks of 4 x 32 (256 tokens a step), resumed in one process: 2
    micro-batches a step; in 3 ranks it cannot be kept, and a given train.tokens_per_step is the user's."""
    base = tiny_overrides(corpus_dir, tmp_path)
    saved = config_state(load_config(None, base | {"parallel.dp_shard": 2}))
    assert "tokens_per_step" not in saved["train"] and global_batch(saved) == 4 * 32 * 2

    one = keep_global_batch(load_config(None, base), saved)
    assert one.train.tokens_per_step == 256 and accumulation_steps(one, 1) == 2
    assert [c.key for c in config_changes(saved, one)] == ["parallel.dp_shard"]  # the batch: no change

    with pytest.raises(
        ConfigError, match=r"^train\.tokens_per_step: the run was trained with 256 tokens"
    ) as e:
        keep_global_batch(load_config(None, base | {"parallel.dp_shard": 3}), saved)
    assert "\n" not in str(e.value)

    given = keep_global_batch(load_config(None, base | {"train.tokens_per_step": 512}), saved)
    assert given.train.tokens_per_step == 512
    assert [(c.key, c.old, c.new) for c in config_changes(saved, given)] == [
        ("parallel.dp_shard", 2, 1),
        ("train.tokens_per_step", 256, 512),
    ]


def test_resume_with_another_micro_batch_keeps_the_global_batch(stopped_run, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="lmforge"):
        code, _, err = run_cli(
            capsys, "train", "--resume", "--run-dir", str(stopped_run), "--train.micro_batch_size=2"
        )
    assert code == 0, err
    assert batch_tokens(stopped_run) == {s: 4 * 32 for s in (5, 10, 15, 20)}  # 2 x 2 sequences after step 10
    assert read_history(stopped_run / "config.toml") == ["# step 10: train.micro_batch_size 4 -> 2"]
    assert load_config(stopped_run / "config.toml").train.tokens_per_step == 128  # the run's batch, written
    assert (
        "resume at step 10: the global batch stays 128 tokens per step: 2 micro-batch(es) of 2 x 32 a step "
        "on each of 1 data-parallel rank(s)" in caplog.text
    )


def test_resume_refuses_a_global_batch_it_cannot_keep(stopped_run, capsys):
    before = (stopped_run / "config.toml").read_text()
    code, _, err = run_cli(
        capsys, "train", "--resume", "--run-dir", str(stopped_run), "--train.micro_batch_size=3"
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("lmforge train: error: train.tokens_per_step: the run was trained with 128 tokens")
    assert "--train.tokens_per_step=N" in err
    assert (stopped_run / "config.toml").read_text() == before  # nothing written
    assert max(batch_tokens(stopped_run)) == 10


def test_an_explicit_change_of_the_global_batch_is_logged_with_the_learning_rate_rule(
    stopped_run, capsys, caplog
):
    with caplog.at_level(logging.INFO, logger="lmforge"):
        code, _, err = run_cli(
            capsys, "train", "--resume", "--run-dir", str(stopped_run), "--train.tokens_per_step=256"
        )
    assert code == 0, err
    assert read_history(stopped_run / "config.toml") == ["# step 10: train.tokens_per_step 128 -> 256"]
    assert batch_tokens(stopped_run) == {5: 128, 10: 128, 15: 256, 20: 256}
    note = next(r.getMessage() for r in caplog.records if "global batch goes from" in r.getMessage())
    assert note.startswith("resume at step 10: the global batch goes from 128 to 256 tokens per step (x2)")
    assert "keeps optim.lr and its schedule as they are" in note
    assert "x2 by the linear rule" in note and "x1.41 by the square-root rule" in note
