"""``metrics.wandb``: the missing extra is a one-line user error before any work; with wandb installed,
an offline run in RUN/wandb that a resume continues under the same id."""

from __future__ import annotations

import sys

import pytest

from lmforge.errors import UserError
from lmforge.recipe import load_config
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.callbacks.sinks import wandb_values
from lmforge.train.launch import train
from tests.conftest import tiny_overrides


def test_missing_wandb_is_a_user_error_before_any_work(corpus_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    cfg = load_config(None, tiny_overrides(corpus_dir, tmp_path / "data") | {"metrics.wandb": True})
    with pytest.raises(UserError, match=r'^metrics.wandb: .*pip install -e "\.\[wandb\]"$'):
        train(cfg, tmp_path / "run", progress_bar=False)
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_wandb_values_are_the_numbers_events_prefixed():
    assert wandb_values({"step": 5, "loss": 2.0, "phase": "a", "ok": True}) == {"loss": 2.0}
    event = {"step": 8, "event": "early_stop", "best_step": 4, "best_val_loss": 1.5}
    assert wandb_values(event) == {"early_stop/best_step": 4, "early_stop/best_val_loss": 1.5}


def test_offline_run_resumes_its_id(corpus_dir, tmp_path):
    pytest.importorskip("wandb")
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "metrics.wandb": True,
        "train.steps": 4,
        "train.log_interval": 1,
        "train.checkpoint_interval": 2,
        "train.sample_tokens": 0,
    }
    cfg = load_config(None, over)
    run_dir = tmp_path / "run"
    train(cfg, run_dir, progress_bar=False, callbacks=[StopAfter(2)])
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    train(cfg, run_dir, resume=True, progress_bar=False)
    assert (run_dir / "wandb" / "run_id").read_text().strip() == run_id
    runs = list((run_dir / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert runs, list((run_dir / "wandb").rglob("*"))
    logged = b"".join(f.read_bytes() for run in runs for f in run.glob("*.wandb"))
    for key in (b"tokens_per_s", b"val_loss", b"grad_norm"):  # the records reached W&B's offline store
        assert key in logged, key
