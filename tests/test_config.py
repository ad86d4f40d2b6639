from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.recipe import (
    MOVED,
    config_keys,
    load_config,
    parse_overrides,
    reference_markdown,
    reference_text,
    to_toml,
)


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
        ({"train.precision": "fp4"}, "train.precision:"),
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
    docs = Path(__file__).parents[1] / "docs" / "config.md"
    assert docs.read_text() == reference_markdown(), "regenerate docs/config.md (command at its top)"


def test_recipes_validate():
    recipes = sorted((Path(__file__).parents[1] / "configs").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        load_config(recipe)
    assert load_config(Path(__file__).parents[1] / "configs" / "default.toml") == Config()


def test_grouped_keys_parse_from_toml_and_command_line(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(
        '[schedule]\nname = "wsd"\n\n[schedule.wsd]\ndecay_fraction = 0.3\n\n'
        "[optim.muon]\nlr = 0.01\n\n[train.adaptive_clip]\nfactor = 3.0\n"
    )
    cfg = load_config(path)
    assert cfg.schedule.name == "wsd" and cfg.schedule.wsd.decay_fraction == 0.3
    assert cfg.optim.muon.lr == 0.01 and cfg.train.adaptive_clip.factor == 3.0
    over = parse_overrides(["--schedule.wsd.decay_fraction=0.4", "--train.value_clip.limit", "0.5"])
    cfg = load_config(path, over)
    assert cfg.schedule.wsd.decay_fraction == 0.4 and cfg.train.value_clip.limit == 0.5
    assert cfg.schedule.wsd.decay_shape == "1-sqrt"  # the rest of the sub-table keeps its defaults


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"schedule.wsd.decay_fractoin": 0.3}, "did you mean schedule.wsd.decay_fraction?"),
        ({"schedule.wsd.decay_fraction": 0}, "schedule.wsd.decay_fraction:"),
        (
            {"train.clip_mode": "value"},
            "train.value_clip.limit: clip_mode 'value' needs train.value_clip.limit above 0",
        ),
        ({"optim.name": "muon", "optim.muon.momentum": 0}, "optim.muon.nesterov: Nesterov needs optim.muon"),
        ({"optim.name": "sgd", "optim.sgd.nesterov": True, "optim.sgd.momentum": 0}, "optim.sgd.nesterov:"),
    ],
)
def test_grouped_key_errors_name_the_grouped_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert needle in str(info.value)


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_moved_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError) as info:
        load_config(None, {old: 1})
    assert str(info.value) == f"{old}: moved to {new}"


def test_moved_table_points_to_real_keys():
    keys = config_keys()
    assert all(new in keys for new in MOVED.values())
    assert not any(old in keys for old in MOVED)


def test_moved_key_in_a_recipe_and_on_the_cli(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[schedule]\nname = "wsd"\ndecay_fraction = 0.3\n')
    with pytest.raises(
        ConfigError, match=r"^schedule\.decay_fraction: moved to schedule\.wsd\.decay_fraction$"
    ):
        load_config(path)
    result = _cli("train", "--optim.muon_lr=0.01", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("optim.muon_lr: moved to optim.muon.lr")


def test_reference_shows_a_header_per_section_and_sub_table():
    lines = reference_text().splitlines()
    head = lines.index('[schedule.wsd]  used when schedule.name = "wsd"')
    assert lines[head + 1].startswith("  --schedule.wsd.decay_fraction=0.2  ")
    assert '[optim.muon]  used when optim.name = "muon"' in lines
    assert '[train.adaptive_clip]  used when train.clip_mode = "adaptive"' in lines
    # every key sits under the header of its own table
    table = None
    for line in lines:
        if line.startswith("["):
            table = line[1 : line.index("]")]
        elif line.strip():
            key = line.split("=", 1)[0].removeprefix("  --").split("[]")[0]
            assert key.rsplit(".", 1)[0] == table, line
    assert "## `[schedule.plateau]`" in reference_markdown()


def test_schema_module_does_not_import_recipe_tooling():
    import ast

    import lmforge.config

    tree = ast.parse(Path(lmforge.config.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert imported  # the walk saw the imports (pydantic at least)
    assert not imported & {"tomllib", "difflib", "lmforge.recipe"}, imported
    code = "import sys, lmforge.config; print(sorted(m for m in ('tomllib', 'difflib', 'lmforge.recipe') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_execution_settings_live_in_train_and_reach_the_model():
    import torch

    from lmforge.train.build import training_module

    cfg = load_config(
        None,
        {"train.attention": "sdpa", "train.loss_chunk": 7, "model.n_layers": 1, "model.d_model": 32},
    )
    assert not cfg.train.deterministic  # schema default; wired elsewhere
    eager = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})})
    module = training_module(eager, 64, torch.device("cpu"))
    assert module.model.attention == "sdpa"
    assert module.train_fn.chunk == 7
    assert "attention" not in cfg.model.model_dump() and "loss_chunk" not in cfg.model.model_dump()


def test_saved_run_configs_with_moved_keys_still_load(tmp_path):
    """Run folders written before a key moved keep loading (eval, generate, resume); recipes do not."""
    from lmforge.recipe import load_saved_config, migrate_moved
    from lmforge.train.resume import config_changes

    old = tmp_path / "config.toml"
    old.write_text('[model]\nattention = "sdpa"\nloss_chunk = 7\n\n[schedule]\ndecay_fraction = 0.3\n')
    cfg = load_saved_config(old)
    assert (cfg.train.attention, cfg.train.loss_chunk, cfg.schedule.wsd.decay_fraction) == ("sdpa", 7, 0.3)
    with pytest.raises(ConfigError, match="moved to"):
        load_config(old)
    saved = {"model": {**cfg.model.model_dump(mode="json", exclude_none=True), "attention": "auto"}}
    changes = config_changes(saved, cfg)  # the moved key is not a model difference
    assert [c.key for c in changes if c.key.startswith("model.")] == []
    assert migrate_moved(saved)["train"] == {"attention": "auto"} and "attention" in saved["model"]


def test_list_of_tables_overrides_read_as_json_or_toml():
    """``--data.sources`` in the JSON form that ``--help`` and docs/config.md print gives the config the
    TOML inline form gives."""
    forms = [
        '[{"path": "x.txt", "domain": "web"}]',
        "[{path='x.txt', domain='web'}]",
        '[{path = "x.txt", domain = "web"}]',
    ]
    configs = [load_config(None, parse_overrides([f"--data.sources={v}"])) for v in forms]
    assert [(s.path, s.domain) for s in configs[0].data.sources] == [("x.txt", "web")]
    assert configs[0] == configs[1] == configs[2]
    json_null = parse_overrides(['--data.sources=[{"path": "x.txt", "domain": null}]'])
    assert json_null == {"data.sources": [{"path": "x.txt", "domain": None}]}  # null: the key's default
    assert parse_overrides(["--data.cache_dir=[not a list"]) == {"data.cache_dir": "[not a list"}
