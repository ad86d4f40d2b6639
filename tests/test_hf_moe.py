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
from lmforge.errors import UserError
from lmforge.hf import glm4_moe
from lmforge.hf.export import arch_map, export_run
from lmforge.hf.import_ import import_hf
from lmforge.hf.moe import TRAINING_KEYS, d_expert, moe_blocks, normalizes
from lmforge.hf.peft import adapted_modules
from lmforge.model.transformer import Transformer, ff_width
from lmforge.posttrain.finetune import start
from lmforge.recipe import load_config, load_saved_config
from lmforge.tokenizer import Tokenizer
from lmforge.train.checkpoint import list_checkpoints, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import cli_args, tiny_overrides
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
from tests.test_posttrain_runs import HELD_OUT_FUNCS, _records

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


def _lora_overrides(tmp_path: Path) -> dict:
    """3 SFT steps with rank-4 adapters on every linear layer of the blocks (attention, dense MLPs, shared
    experts, routers) and adapter dropout on (which PEFT's parameter targets lack: written as 0)."""
    return {
        "posttrain.train_files": [str(_records(tmp_path / "train.jsonl", 12))],
        "posttrain.val_files": [str(_records(tmp_path / "val.jsonl", 4, HELD_OUT_FUNCS))],
        "train.steps": 3,
        "train.micro_batch_size": 4,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 3,
        "train.checkpoint_interval": 3,
        "train.sample_tokens": 0,
        "schedule.warmup": 1,
        "optim.lr": 1e-2,
        "lora.rank": 4,
        "lora.alpha": 8.0,
        "lora.dropout": 0.1,
        "lora.targets": "all-linear",
    }


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_moe_lora_adapter_loads_in_peft_with_the_runs_logits(name, runs, tmp_path):
    """``export --adapter`` of an MoE LoRA run (each class: Mixtral's routers and attention, Qwen2-MoE's dense
    blocks' MLPs too, GLM's shared experts too): every adapted layer is in the folder under the module
    ``transformers`` 5 loads it into, ``peft`` loads it onto the exported base, and its logits are the
    lmforge LoRA model's and those of the merged export loaded by ``transformers``."""
    from peft import PeftModel

    run = tmp_path / "lora"
    cfg, _ = start("sft", runs[name], run, overrides=_lora_overrides(tmp_path))
    train(cfg, run, resume=True, progress_bar=False)
    folder = export_run(run, adapter=True)
    config = json.loads((folder / "adapter_config.json").read_text())
    state = load_checkpoint(list_checkpoints(run)[-1])["model"]
    adapted = [k for k in state if k.endswith(".lora_A")]
    params = config["target_parameters"] or []
    assert len(config["target_modules"]) + len(params) == len(adapted) > 0
    assert all(".self_attn." in m for m in config["target_modules"]) and config["lora_dropout"] == 0.0
    assert all(".self_attn." not in p and ".block_sparse_moe." not in p for p in params)
    assert any(p.endswith(".mlp.gate.weight") for p in params)  # the routers: every class
    # every B moved off its 0 (the routers' too: LoRA adapts them in lmforge's forward), so each layer's
    # mapping is tested by its values, not only its name
    assert all(state[k.removesuffix("A") + "B"].abs().max() > 0 for k in adapted)
    base = hf_model(Path(config["base_model_name_or_path"]))
    ids = _ids(run)
    alone = hf_logits(base, ids)
    peft = hf_logits(PeftModel.from_pretrained(base, folder).eval(), ids)
    merged = hf_logits(hf_model(export_run(run, tmp_path / "merged")), ids)
    ours = lmforge_logits(run, ids)
    gaps = {
        "peft vs lmforge": (peft - ours).abs().max().item(),
        "peft vs merged": (peft - merged).abs().max().item(),
        "base alone": (alone - ours).abs().max().item(),
    }
    print(name, gaps)
    # TOL (1e-4, the MoE export's bound above): the same FP32 weights summed in other orders, B (A x) against
    # (W + s B A) x, over the same top-k (routers in FP32 on both sides)
    assert gaps["peft vs lmforge"] <= TOL and gaps["peft vs merged"] <= TOL
    assert gaps["base alone"] > 100 * TOL  # the adapters matter: 3 steps at lr 1e-2 move the logits


def test_an_adapted_layer_without_a_renamed_weight_is_refused_by_name():
    """A layer whose weight the export map reshapes (the routed experts, were they adapted) is refused in one
    line that names it and says the fix; the renamed ones map to their ``transformers`` 5 modules."""
    cfg = load_config(None, {"model.n_layers": 2, "model.moe.experts": 4, "model.moe.normalize": True})
    arch = arch_map(cfg.model)
    with torch.device("meta"):
        keys = list(Transformer(cfg.model, 64, 32, "sdpa").state_dict())
    got = adapted_modules(arch, cfg, keys, ["blocks.1.attn.q_proj", "blocks.1.mlp.router"])
    assert got == {
        "blocks.1.attn.q_proj": "model.layers.1.self_attn.q_proj",
        "blocks.1.mlp.router": "model.layers.1.mlp.gate",
    }
    with pytest.raises(
        UserError, match=r"^--adapter: the adapted layers blocks\.0\.mlp\.experts have no "
    ) as e:
        adapted_modules(arch, cfg, keys, ["blocks.0.attn.q_proj", "blocks.0.mlp.experts"])
    assert "lora.targets" in str(e.value) and "\n" not in str(e.value)


# Qwen2-MoE and GLM-4 MoE models built by transformers from their config classes (not written by lmforge),
# scaled down: 3 blocks, width 32, 4 heads (2 kv), 4 experts top-2, block 0 dense
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ_LEN,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,  # logits of a few units, so a wrong map shows (0.02 gives near-uniform ones)
}


def _foreign(kind: str, vocab: int, **changes):
    """The ``transformers`` config of ``kind`` with its class's defaults, :data:`SMALL` and ``changes``."""
    from transformers import Glm4MoeConfig, Qwen2MoeConfig

    if kind == "qwen2_moe":
        return Qwen2MoeConfig(vocab_size=vocab, num_experts=4, mlp_only_layers=[0], **{**SMALL, **changes})
    return Glm4MoeConfig(vocab_size=vocab, n_routed_experts=4, **{**SMALL, **changes})


def _folder(exported: Path, dst: Path, config, weights: bool = True) -> Path:
    """A Hugging Face folder of ``config`` (a model of it initialised by ``transformers`` from seed 0 when
    ``weights``, else the config alone) with the exported runs' tokenizer."""
    from transformers import AutoModelForCausalLM

    dst.mkdir()
    if weights:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # GLM's correction bias away from its zeros, so that importing it matters
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn_like(buf) * 0.1)
        model.save_pretrained(dst)
    else:
        config.save_pretrained(dst)
    shutil.copyfile(exported / "tokenizer.json", dst / "tokenizer.json")
    return dst


@pytest.mark.parametrize(
    "kind, changes",
    [
        ("qwen2_moe", {"shared_expert_intermediate_size": 0, "qkv_bias": False}),
        ("glm4_moe", {"partial_rotary_factor": 1.0}),  # the class's defaults otherwise: a shared expert
    ],
)
def test_a_foreign_config_of_the_variant_lmforge_reads_imports_with_transformers_logits(
    kind, changes, exported, corpus_dir, tmp_path
):
    """A model ``transformers`` built from its class's own config (Qwen2-MoE without the shared expert and
    q/k/v biases; GLM-4 MoE with its defaults, a shared expert, a dense first block, the multi-token
    prediction layer and a nonzero correction bias, but full rotary), saved by ``save_pretrained``:
    ``lmforge import`` reads it, and the imported run's logits are the transformers model's."""
    vocab = Tokenizer(exported[kind] / "tokenizer.json").vocab_size
    folder = _folder(exported[kind], tmp_path / "hf", _foreign(kind, vocab, **changes))
    import_hf(folder, tmp_path / "run", None, import_overrides(corpus_dir, tmp_path / "data"))
    ids = Tokenizer(folder / "tokenizer.json").encode(sample_text())[:SEQ_LEN]
    theirs = hf_logits(hf_model(folder), ids)
    diff = (lmforge_logits(tmp_path / "run", ids) - theirs).abs().max().item()
    print(f"{kind}: max |logit diff| {diff:.3g}, logit std {theirs.std().item():.3g}")
    assert diff <= TOL  # the export's bound above: the same FP32 weights, the same top-k
    # logits far from uniform (measured std 0.58 and 0.57): a wrong map would show
    assert theirs.std().item() > 1000 * TOL


@pytest.mark.parametrize(
    "kind, changes, fields",
    [
        (  # Qwen2MoeConfig's defaults: the released Qwen1.5-MoE layout (shared expert, q/k/v biases)
            "qwen2_moe",
            {"shared_expert_intermediate_size": 48},
            ["shared_expert_intermediate_size = 48", "qkv_bias = True"],
        ),
        (  # the released GLM-4.5 features: partial rotary (the class's default), qk-norm, q/k/v biases,
            # a head size of its own, a routed scaling factor
            "glm4_moe",
            {"use_qk_norm": True, "attention_bias": True, "head_dim": 16, "routed_scaling_factor": 2.5},
            [
                "partial_rotary_factor = 0.5",
                "use_qk_norm = True",
                "attention_bias = True",
                "routed_scaling_factor = 2.5",
                "head_dim = 16",
            ],
        ),
    ],
)
def test_released_style_configs_are_refused_naming_every_field(
    kind, changes, fields, exported, corpus_dir, tmp_path, capsys, cli_logging
):
    """A released-style config.json (the class's defaults, or GLM-4.5's features) is refused by ``lmforge
    import`` in one line, exit status 2, before anything is written, naming every field lmforge's model
    lacks with its value and what lmforge reads there."""
    vocab = Tokenizer(exported[kind] / "tokenizer.json").vocab_size
    folder = _folder(exported[kind], tmp_path / "hf", _foreign(kind, vocab, **changes), weights=False)
    flags = cli_args(import_overrides(corpus_dir, tmp_path / "data"))
    with pytest.raises(SystemExit) as done:
        main(["import", str(folder), "--run-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1, err
    for field in fields:
        assert f"config.json field {field} is not supported" in err[0]
    assert err[0].count("lmforge reads") + err[0].count("lmforge's head dimension") == len(fields)
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
