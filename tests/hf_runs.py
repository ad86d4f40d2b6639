"""Tiny trained runs of each architecture and the comparisons the Hugging Face tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.corpus.pystdlib import stdlib_root
from lmforge.evaluate.generation import prompt_of
from lmforge.evaluate.run_loading import load_run
from lmforge.hf.import_ import FROM_FOLDER
from lmforge.model.sampling import generate
from lmforge.recipe import load_config
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

SEQ_LEN = 96  # prompt + 50 generated tokens fit: no sliding window in lmforge's generate, none in HF's
VARIANTS = {
    "llama_gqa_untied": {"model.arch": "llama", "model.n_kv_heads": 2, "model.tie_embeddings": False},
    "llama_tied": {"model.arch": "llama", "model.tie_embeddings": True, "model.rope_theta": 500.0},
    "gpt2": {"model.arch": "gpt2", "model.tie_embeddings": True},
}
# mixtures of experts, one per Hugging Face class they export to (hf/moe.py::pick_class)
MOE_VARIANTS = {
    "mixtral": {"model.n_layers": 3, "model.moe.experts": 4, "model.moe.normalize": True},
    "qwen2_moe": {  # softmax without renormalising, dense blocks 0 and 2, a capacity factor (training only)
        "model.n_layers": 4,
        "model.tie_embeddings": False,
        "model.moe.experts": 4,
        "model.moe.first_dense": 1,
        "model.moe.every": 2,
        "model.moe.d_expert": 24,
        "model.moe.capacity_factor": 1.5,
        "model.moe.aux_loss": 0.01,
    },
    "glm4_moe": {  # sigmoid with the balancing bias (moved fast enough to change choices), a shared expert
        "model.n_layers": 3,
        "model.moe.experts": 4,
        "model.moe.score": "sigmoid",
        "model.moe.shared_experts": 1,
        "model.moe.first_dense": 1,
        "model.moe.d_expert": 24,
        "model.moe.bias_update_rate": 0.05,
    },
}


def train_tiny(corpus_dir: Path, root: Path, name: str, steps: int = 8) -> Path:
    """A run of variant ``name`` trained ``steps`` steps in fp32 (checkpoints at steps/2 and steps)."""
    over = {
        **tiny_overrides(corpus_dir, root / "data"),
        "data.seq_len": SEQ_LEN,
        "train.steps": steps,
        "train.checkpoint_interval": steps // 2,
        "train.eval_interval": steps,
        "train.eval_tokens": 512,
        "optim.lr": 1e-2,
        **{**VARIANTS, **MOE_VARIANTS}[name],
    }
    run = root / name
    train(load_config(None, over), run, progress_bar=False)
    return run


def import_overrides(corpus_dir: Path, cache: Path, steps: int = 8) -> dict:
    """The tiny runs' data and training keys, without what an import takes from the folder."""
    over = {**tiny_overrides(corpus_dir, cache), "train.steps": steps, "train.eval_tokens": 512}
    return {k: v for k, v in over.items() if not k.startswith("model.") and k not in FROM_FOLDER}


_TRAINED: dict[str, Path] = {}


def trained_runs(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny trained run per variant, trained once per test session (the export and import tests
    share them)."""
    if not _TRAINED:
        root = tmp_path_factory.mktemp("hf-runs")
        _TRAINED.update({name: train_tiny(corpus_dir, root, name) for name in VARIANTS})
    return dict(_TRAINED)


def sample_text() -> str:
    """Real text the tiny models never trained on: a standard-library module's source."""
    return (stdlib_root() / "json" / "decoder.py").read_text(encoding="utf-8")


def lmforge_logits(run: Path, ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of the run's newest checkpoint."""
    _, _, model, _ = load_run(run, torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        return model.logits(model(torch.tensor([ids])))[0].float()


def lmforge_greedy(run: Path, prompt: list[int], n: int) -> list[int]:
    _, tok, model, _ = load_run(run, torch.device("cpu"))
    return generate(model, prompt, n, temperature=0.0, stop_token=tok.eot_id)


def lmforge_generate_ids(run: Path, prompt: str, n: int) -> list[int]:
    """The ids ``lmforge generate RUN --prompt PROMPT --temperature 0`` samples (its prompt, its stop)."""
    _, tok, model, _ = load_run(run, torch.device("cpu"))
    ids, stop, _ = prompt_of(tok, None, prompt)
    return generate(model, ids, n, temperature=0.0, stop_token=stop)


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int, eot: int) -> list[int]:
    """HF greedy continuation of ``prompt``, cut before the end-of-text token as lmforge's stops there."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eot, pad_token_id=eot
        )
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(eot)] if eot in new else new
