"""``lmforge import``: a Hugging Face folder becomes a run that ``eval``, ``generate``, ``export`` and
``train --resume`` accept; export -> import -> export is bitwise the same; what lmforge lacks is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.hf.export import export_run
from lmforge.hf.import_ import import_hf
from lmforge.train.checkpoint import list_checkpoints, load_checkpoint
from tests.conftest import cli_args
from tests.hf_runs import (
    SEQ_LEN,
    VARIANTS,
    hf_logits,
    hf_model,
    import_overrides,
    lmforge_greedy,
    lmforge_logits,
    sample_text,
    trained_runs,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    return trained_runs(corpus_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-import-src")
    return {name: export_run(run, root / name) for name, run in runs.items()}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache for every import (the corpus tokenised once per tokenizer)."""
    return tmp_path_factory.mktemp("hf-import-cache")


@pytest.fixture(scope="module")
def imported(exported, corpus_dir, cache, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-imported")
    over = import_overrides(corpus_dir, cache)
    for name, folder in exported.items():
        import_hf(folder, root / name, None, over)
    return {name: root / name for name in exported}


def _ids(run: Path) -> list[int]:
    from lmforge.tokenizer import Tokenizer

    return Tokenizer(run / "tokenizer.json").encode(sample_text())[:SEQ_LEN]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_is_bitwise(name, exported, imported, tmp_path):
    again = export_run(imported[name], tmp_path / "again")
    first, second = load_file(exported[name] / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    for key, value in first.items():
        assert value.dtype == second[key].dtype and torch.equal(value, second[key]), key
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported[name] / f).read_text() == (again / f).read_text(), f


@pytest.mark.parametrize("name", list(VARIANTS))
def test_imported_run_computes_what_the_original_does(name, runs, imported):
    ids = _ids(runs[name])
    assert torch.equal(lmforge_logits(imported[name], ids), lmforge_logits(runs[name], ids))
    ckpt = load_checkpoint(list_checkpoints(imported[name])[-1])
    assert ckpt["progress"]["step"] == 0 and ckpt["optimizer"] == {}


def test_eval_generate_and_resume_accept_the_imported_run(runs, imported, capsys, cli_logging):
    run = imported["llama_gqa_untied"]
    with pytest.raises(SystemExit) as done:
        main(["eval", str(run), "--tokens", "256", "--device", "cpu"])
    assert done.value.code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 0 and result["val_loss"] > 0
    with pytest.raises(SystemExit) as done:
        main(["generate", str(run), "--prompt", "def ", "--temperature", "0", "--max-new-tokens", "12"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("def ")
    with pytest.raises(SystemExit) as done:
        main(["train", "--resume", "--run-dir", str(run), "--train.steps=4", "--train.checkpoint_interval=4"])
    assert done.value.code == 0
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000004"
    before, after = load_checkpoint(list_checkpoints(run)[0]), load_checkpoint(list_checkpoints(run)[-1])
    assert not torch.equal(before["model"]["embed.weight"], after["model"]["embed.weight"])
    assert after["optimizer"]  # moments from the first resumed step on


def test_a_folder_saved_by_transformers_imports(runs, exported, imported, corpus_dir, cache, tmp_path):
    """``save_pretrained``'s own config.json and sharded weights (index + shards) import; the logits
    are lmforge's original ones."""
    name = "llama_gqa_untied"
    folder = tmp_path / "saved"
    hf_model(exported[name]).save_pretrained(folder, max_shard_size="40KB")
    shutil.copyfile(exported[name] / "tokenizer.json", folder / "tokenizer.json")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    run = tmp_path / "run"
    import_hf(folder, run, None, import_overrides(corpus_dir, cache))
    ids = _ids(runs[name])
    assert torch.equal(lmforge_logits(run, ids), lmforge_logits(runs[name], ids))
    prompt = [0, *ids[:16]]
    assert lmforge_greedy(run, prompt, 20) == lmforge_greedy(runs[name], prompt, 20)
    # test_hf_export.py's TOL: two implementations' FP32 kernels on the same weights (measured 4.8e-7 there)
    assert (hf_logits(hf_model(folder), ids) - lmforge_logits(run, ids)).abs().max() <= 1e-4


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "name, changes, field",
    [
        ("llama_tied", {"architectures": ["MistralForCausalLM"]}, "architectures"),
        ("llama_tied", {"architectures": None, "model_type": "qwen2"}, "model_type"),
        ("llama_tied", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        (
            "llama_tied",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
            "rope_parameters.rope_type",
        ),
        ("llama_tied", {"attention_bias": True}, "mlp_bias"),
        ("llama_tied", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama_tied", {"sliding_window": 16}, "sliding_window"),
        ("llama_tied", {"head_dim": 16}, "head_dim"),
        ("llama_tied", {"vocab_size": 600}, "vocab_size"),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_what_lmforge_lacks_is_refused(name, changes, field, exported, corpus_dir, tmp_path):
    folder = _edited(exported[name], tmp_path / "hf", **changes)
    with pytest.raises(UserError, match=rf"config.json field {field} = .* is not supported"):
        import_hf(folder, tmp_path / "run", None, import_overrides(corpus_dir, tmp_path / "data"))
    assert not (tmp_path / "run").exists()


def test_import_refuses_a_run_with_checkpoints_and_model_flags(runs, exported, corpus_dir, tmp_path):
    over = import_overrides(corpus_dir, tmp_path / "data")
    with pytest.raises(UserError, match=r"--run-dir: .* already holds checkpoints"):
        import_hf(exported["gpt2"], runs["gpt2"], None, over)
    with pytest.raises(UserError, match=r"--model\.n_layers: comes from"):
        import_hf(exported["gpt2"], tmp_path / "run", None, {**over, "model.n_layers": 3})


def test_cli_import_refusal_is_one_line(exported, corpus_dir, tmp_path, capsys, cli_logging):
    folder = _edited(exported["gpt2"], tmp_path / "hf", n_inner=None, activation_function="gelu")
    flags = cli_args(import_overrides(corpus_dir, tmp_path / "data"))
    with pytest.raises(SystemExit) as done:
        main(["import", str(folder), "--run-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1 and "activation_function" in err[0]
