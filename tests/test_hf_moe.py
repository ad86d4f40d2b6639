"""Mixtures of experts through ``lmforge export`` / ``import``: tiny trained MoE runs load in
``transformers`` as the class whose routing is lmforge's (Mixtral, Qwen2-MoE, GLM-4 MoE) with lmforge's
logits (FP32, within 1e-4) and greedy tokens; imported back they compute what the original does, with the
same MoE config; option sets no class reproduces are refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import UserError
from lmforge.hf import glm4_moe
from lmforge.hf.export import arch_map, export_run
from lmforge.hf.import_ import import_hf
from lmforge.hf.moe import TRAINING_KEYS, d_expert, moe_blocks, normalizes
from lmforge.model.transformer import ff_width
from lmforge.recipe import load_config, load_saved_config
from lmforge.train.checkpoint import list_checkpoints, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides
from tests.hf_runs import (
    MOE_VARIANTS,
    SEQ_LEN,
    hf_greedy,
    hf_logits,
    hf_model,
    import_overrides,
    lmforge_greedy,
    lmforge_logits,
    sample_text,
    train_tiny,
)

pytest.importorskip("transformers")

# Largest |logit difference| between transformers 5.24's model and lmforge's on the same FP32 weights,
# measured on a 2-core machine (test_logits_and_greedy_match prints it): see docs/hf.md. Routing takes
# the same top-k on both sides (the router runs in FP32 on both), so only rounding in other orders is left.
TOL = 1e-4
GREEDY = 12
CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-moe-runs")
    return {name: train_tiny(corpus_dir, root, name) for name in MOE_VARIANTS}


@pytest.fixture(scope="module")
def exported(runs) -> dict[str, Path]:
    return {name: export_run(run) for name, run in runs.items()}


@pytest.fixture(scope="module")
def imported(exported, corpus_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-moe-imported")
    over = import_overrides(corpus_dir, root / "data")
    for name, folder in exported.items():
        import_hf(folder, root / name, None, over)
    return {name: root / name for name in exported}


def _ids(run: Path) -> list[int]:
    return Tokenizer(run / "tokenizer.json").encode(sample_text())[:SEQ_LEN]


def _diff(folder: Path, run: Path) -> float:
    ids = _ids(run)
    return (hf_logits(hf_model(folder), ids) - lmforge_logits(run, ids)).abs().max().item()


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_logits_and_greedy_match(name, runs, exported):
    run, folder = runs[name], exported[name]
    model = hf_model(folder)
    assert type(model).__name__ == CLASSES[name]
    ids = _ids(run)
    diff = (hf_logits(model, ids) - lmforge_logits(run, ids)).abs().max().item()
    print(f"{name}: max |logit diff| {diff:.3g}")
    assert diff <= TOL
    eot = Tokenizer(run / "tokenizer.json").eot_id
    prompt = [eot, *ids[:24]]
    ours = lmforge_greedy(run, prompt, GREEDY)
    assert len(ours) == GREEDY
    assert hf_greedy(model, prompt, GREEDY, eot) == ours


def test_the_balancing_bias_is_what_glm_routes_with(runs, exported, tmp_path):
    """The trained bias is not zero and changes the routing: the same folder with GLM's correction bias
    zeroed gives other logits (so the export of the bias is tested, not only its name)."""
    state = load_checkpoint(list_checkpoints(runs["glm4_moe"])[-1])["model"]
    assert state["blocks.1.mlp.expert_bias"].abs().max() >= 0.05  # one step's move at least
    folder = tmp_path / "unbiased"
    folder.mkdir()
    for f in exported["glm4_moe"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.endswith("e_score_correction_bias")]:
        tensors[key] = torch.zeros_like(tensors[key])
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    assert _diff(folder, runs["glm4_moe"]) > 10 * TOL  # measured 5.5e-3


def _effective(model: ModelConfig) -> dict:
    """The MoE model as it computes: blocks, routing, widths, and the training-only keys."""
    m = model.moe
    return {
        "moe_blocks": moe_blocks(model),
        "experts": m.experts,
        "top_k": m.top_k,
        "score": m.score,
        "normalize": normalizes(m),
        "shared_experts": m.shared_experts,
        "d_expert": d_expert(model),
        "dense_width": None if len(moe_blocks(model)) == model.n_layers else ff_width(model),
        **{k: getattr(m, k) for k in TRAINING_KEYS},
        "attention": (model.n_layers, model.d_model, model.n_heads, model.tie_embeddings, model.rope_theta),
    }


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_import_round_trips(name, runs, exported, imported, tmp_path):
    ids = _ids(runs[name])
    assert torch.equal(lmforge_logits(imported[name], ids), lmforge_logits(runs[name], ids))
    ours = load_saved_config(runs[name] / "config.toml").model
    back = load_saved_config(imported[name] / "config.toml").model
    assert _effective(back) == _effective(ours)
    again = export_run(imported[name], tmp_path / "again")  # export -> import -> export: the same files
    first, second = load_file(exported[name] / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(v, second[k]) for k, v in first.items())
    assert (exported[name] / "config.json").read_text() == (again / "config.json").read_text()


def test_a_glm_folder_saved_by_transformers_imports(runs, exported, corpus_dir, tmp_path):
    """``save_pretrained``'s config.json (every GLM key spelled out) and weights import; the routing bias
    comes back from the file, so the logits are the original run's."""
    folder = tmp_path / "saved"
    hf_model(exported["glm4_moe"]).save_pretrained(folder)
    shutil.copyfile(exported["glm4_moe"] / "tokenizer.json", folder / "tokenizer.json")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["lmforge_moe"]["bias_update_rate"] == 0.05  # transformers keeps the key
    import_hf(folder, tmp_path / "run", None, import_overrides(corpus_dir, tmp_path / "data"))
    ids = _ids(runs["glm4_moe"])
    diff = (lmforge_logits(tmp_path / "run", ids) - lmforge_logits(runs["glm4_moe"], ids)).abs().max().item()
    assert diff == 0.0


def _model(**moe) -> ModelConfig:
    return ModelConfig(n_layers=3, d_model=32, n_heads=4, moe={"experts": 4, **moe})


@pytest.mark.parametrize(
    "moe, field",
    [
        ({"bias_update_rate": 0.001}, "model.moe.bias_update_rate"),
        ({"shared_experts": 1}, "model.moe.shared_experts"),
        ({"score": "sigmoid", "every": 2}, "model.moe.every"),
    ],
)
def test_options_no_class_reproduces_are_refused(moe, field):
    with pytest.raises(UserError, match=rf"^{field}: .* cannot be exported to Hugging Face: .*; "):
        arch_map(_model(**moe))


@pytest.mark.parametrize(
    "moe, cls",
    [
        ({"normalize": True}, "mixtral"),
        ({}, "qwen2_moe"),  # softmax without renormalising
        ({"normalize": True, "first_dense": 1}, "qwen2_moe"),  # a dense block
        ({"score": "sigmoid", "first_dense": 1, "shared_experts": 2}, "glm4_moe"),
        ({"capacity_factor": 1.25, "normalize": True}, "mixtral"),  # training only: exports
    ],
)
def test_each_option_set_picks_its_class(moe, cls):
    assert cls == arch_map(_model(**moe)).MODEL_TYPE


def test_cli_export_refusal_is_one_line_and_writes_nothing(corpus_dir, tmp_path, capsys, cli_logging):
    over = {
        **tiny_overrides(corpus_dir, tmp_path / "data"),
        "train.steps": 2,
        "train.checkpoint_interval": 2,
        "train.eval_interval": 2,
        "train.eval_tokens": 256,
        "model.moe.experts": 4,
        "model.moe.bias_update_rate": 0.001,
    }
    run = tmp_path / "run"
    train(load_config(None, over), run, progress_bar=False)
    with pytest.raises(SystemExit) as done:
        main(["export", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and "model.moe.bias_update_rate" in err[0]
    assert not (run / "hf").exists()


def _edited(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    hf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**hf, **changes}))
    return dst


@pytest.mark.parametrize(
    "name, changes, field",
    [
        ("glm4_moe", {"use_qk_norm": True}, "use_qk_norm"),
        ("glm4_moe", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
        ("glm4_moe", {"n_group": 2, "topk_group": 1}, "n_group"),
        (
            "glm4_moe",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ("qwen2_moe", {"shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size"),
        ("qwen2_moe", {"mlp_only_layers": [0, 3]}, "mlp_only_layers"),  # MoE blocks 1, 2 of 4
        ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ],
)
def test_what_lmforge_lacks_is_refused_on_import(name, changes, field, exported, corpus_dir, tmp_path):
    folder = _edited(exported[name], tmp_path / "hf", **changes)
    with pytest.raises(UserError, match=rf"config.json field {field} = .* is not supported"):
        import_hf(folder, tmp_path / "run", None, import_overrides(corpus_dir, tmp_path / "data"))
    assert not (tmp_path / "run").exists()


def test_a_foreign_glm_config_routes_with_its_bias():
    """A GLM-4 MoE config.json lmforge did not write (no ``lmforge_moe`` key) imports with a bias rate
    above zero, the only way lmforge's router adds the checkpoint's correction bias."""
    hf = {
        k: v
        for k, v in glm4_moe.config_to_hf(_model(score="sigmoid"), 512, 64, 0).items()
        if k != "lmforge_moe"
    }
    model, _ = glm4_moe.config_from_hf(hf, "config.json")
    assert model.moe.bias_update_rate == glm4_moe.FOREIGN_BIAS_RATE > 0
