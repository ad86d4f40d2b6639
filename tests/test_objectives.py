"""The training objectives' registry (``train/modules.py``): ``train.objective`` names a registered
:class:`~lmforge.train.modules.Objective`, lmforge's own post-training ones and another package's alike
come from the entry-point group ``lmforge.objectives``, and a new objective is a new module: a package
that defines one and its entry point train through ``lmforge train`` with no edit of the engine."""

from __future__ import annotations

import json

import pytest

from lmforge.cli import main
from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.posttrain import objective_dpo, objective_reward, objective_rl, objective_sft
from lmforge.recipe import load_config
from lmforge.train import modules
from lmforge.train.launch import train
from lmforge.train.modules import LanguageModel, LanguageModelModule, ModuleParts, objective_for, register
from tests.conftest import cli_args, tiny_overrides


class CountingModule(LanguageModelModule):
    """A training module of its own (the next-token loss, and the micro-batches it ran as a metric)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ran = 0

    def forward_backward(self, batch, n_targets, dp, precision):
        self.ran += 1
        return super().forward_backward(batch, n_targets, dp, precision)

    def take_metrics(self) -> dict[str, float]:
        return {**super().take_metrics(), "plugin/micro_batches": float(self.ran)}


class Counting(LanguageModel):
    """What another package would define: an objective with its own training module."""

    def module(self, parts: ModuleParts) -> CountingModule:
        return CountingModule(parts.model, parts.train_fn, parts.eval_fn, parts.sync, parts.whole)


PLUGIN = Counting()  # named by the entry point below, as a package's pyproject.toml would


def _cfg(name: str) -> Config:
    return Config.model_validate({"train": {"objective": name}})


def test_lmforge_objectives_come_from_their_entry_points():
    assert type(objective_for(_cfg("lm"))) is LanguageModel
    for name, module in (
        ("sft", objective_sft),
        ("dpo", objective_dpo),
        ("reward", objective_reward),
        ("rl", objective_rl),
    ):
        assert objective_for(_cfg(name)) is module.OBJECTIVE
    assert set(modules.registered()) >= {"lm", "sft", "dpo", "reward", "rl"}
    assert [objective_for(_cfg(n)).rows for n in ("lm", "sft", "dpo", "reward", "rl")] == [1, 1, 2, 2, 1]


def test_register_refuses_what_is_no_objective_and_a_second_one_of_a_name():
    with pytest.raises(TypeError, match="lacks the hooks"):
        register("nothing", object())
    with pytest.raises(ValueError, match="'lm' is registered already"):
        register("lm", LanguageModel())
    register("lm", objective_for(_cfg("lm")))  # the same one again: nothing changes


def test_an_unknown_objective_is_refused_in_one_line_before_any_work(
    corpus_dir, tmp_path, capsys, cli_logging
):
    with pytest.raises(ConfigError, match=r"train\.objective: 'nope' is no registered objective"):
        objective_for(_cfg("nope"))
    run = tmp_path / "run"
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {"train.objective": "nope"}
    with pytest.raises(SystemExit) as done:
        main(["train", "--run-dir", str(run), *cli_args(over)])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(
        "lmforge train: error: train.objective: 'nope' is no registered objective; use one"
    )
    assert "dpo, lm, reward, rl, sft" in err[0] and "lmforge.objectives" in err[0]
    assert not run.exists() and not (tmp_path / "data").exists()


def test_a_new_objective_is_a_new_module_and_an_entry_point(corpus_dir, tmp_path, monkeypatch):
    """A package offering ``counting = "tests.test_objectives:PLUGIN"`` (an installed distribution's
    ``entry_points.txt`` on ``sys.path``) trains through ``lmforge.train.launch.train`` as it is."""
    site = tmp_path / "site"
    info = site / "counting_objective-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: counting-objective\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lmforge.objectives]\ncounting = tests.test_objectives:PLUGIN\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(modules._OBJECTIVES, "counting", raising=False)
    assert "counting" in modules.registered()
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.objective": "counting",
        "train.steps": 2,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.eval_tokens": 256,
        "train.checkpoint_interval": 2,
        "train.sample_tokens": 0,
    }
    summary = train(load_config(None, over), tmp_path / "run", progress_bar=False)
    assert objective_for(_cfg("counting")) is PLUGIN
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    counts = [r["plugin/micro_batches"] for r in records if "plugin/micro_batches" in r]
    assert counts == [1.0, 2.0]  # one micro-batch a step, counted by the objective's own module
    assert summary["step"] == 2 and summary["val_loss"] > 0 and "val_ppl" in summary
