from __future__ import annotations

import subprocess
import sys

import pytest

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.recipe import load_config, parse_overrides, reference_text, to_toml


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = Config()
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_overrides_are_typed():
    over = parse_overrides(
        ["--optim.lr=3e-4", "--train.steps", "20", "--optim.betas=[0.9, 0.99]", "--data.cache_dir=x"]
    )
    cfg = load_config(None, over)
    assert cfg.optim.lr == 3e-4 and cfg.train.steps == 20 and cfg.optim.betas == (0.9, 0.99)
    assert cfg.data.cache_dir == "x"


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"optim.lrr": 1.0}, "optim.lrr: unknown key; did you mean optim.lr?"),
        ({"train.stepz": 1}, "did you mean train.steps?"),
        ({"train.steps": "many"}, "train.steps:"),
        ({"train.steps": 0}, "train.steps:"),
        ({"model.n_heads": 7}, "model.n_heads: d_model (256) must be divisible by n_heads (7)"),
        ({"optim.betas": [0.9, 1.5]}, "optim.betas:"),
        ({"train.precision": "fp8"}, "train.precision:"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_recipe_unknown_section(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text("[optimizer]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match="optimizer: unknown key; did you mean optim"):
        load_config(path)


def test_reference_lists_every_key():
    text = reference_text()
    for key in [
        "model.n_layers",
        "data.seq_len",
        "train.tokens_per_step",
        "optim.betas",
        "schedule.min_lr_ratio",
    ]:
        assert f"--{key}=" in text


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--optim.lrr=1"], "optim.lrr: unknown key; did you mean optim.lr?"),
        (["--config", "missing.toml"], "--config missing.toml: no such file"),
        (["--data.sources=[{path='nowhere/*.jsonl'}]"], "data.sources[0].path: nowhere/*.jsonl matches no"),
        (["--data.sources=[{path='nowhere.txt'}]"], "nowhere.txt does not exist"),
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tmp_path, args, needle):
    result = _cli("train", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()  # nothing half-written


def test_train_help_lists_keys(tmp_path):
    result = _cli("train", "--help", cwd=tmp_path)
    assert result.returncode == 0
    assert "--optim.lr=" in result.stdout and "--train.precision=" in result.stdout


def test_docs_reference_is_current():
    from pathlib import Path

    from lmforge.recipe import reference_markdown

    docs = Path(__file__).parents[1] / "docs" / "config.md"
    assert docs.read_text() == reference_markdown(), "regenerate docs/config.md (command at its top)"


def test_recipes_validate():
    from pathlib import Path

    recipes = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        load_config(recipe)
    assert load_config(Path(__file__).parents[1] / "configs" / "default.toml") == Config()
