"""``lmforge import HF_DIR --run-dir RUN``: a Hugging Face ``LlamaForCausalLM`` / ``GPT2LMHeadModel``
folder (or a mixture of experts: ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``, ``Glm4MoeForCausalLM``)
as an lmforge run folder that ``eval``, ``generate``, ``export`` and ``train --resume`` accept.

``model.*`` and ``data.seq_len`` (the context length) come from ``config.json``, the tokenizer is the
folder's ``tokenizer.json`` (it must hold lmforge's ``<|endoftext|>``, the document separator); the other
keys from the recipe and ``--KEY=VALUE`` flags as for ``lmforge train``. The run is built as training
builds it (its data prepared with that tokenizer), the weights put in, and the state of a run about to
take its first step saved as checkpoint ``step_00000000``: a fresh optimizer (no moments yet), schedule
at step 0, loader at its start. ``train --resume`` then trains from the imported weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from lmforge.config import Config
from lmforge.errors import DataError, UserError
from lmforge.hf import glm4_moe, gpt2, llama, mixtral, qwen2_moe
from lmforge.hf.common import refuse_import
from lmforge.hf.files import read_config, read_weights
from lmforge.recipe import load_config
from lmforge.tokenizer import EOT, Tokenizer
from lmforge.train.callbacks.checkpointing import config_state
from lmforge.train.checkpoint import latest_checkpoint, save_checkpoint
from lmforge.train.resume import config_text

MAPS = (llama, gpt2, mixtral, qwen2_moe, glm4_moe)
BY_ARCHITECTURE = {m.ARCHITECTURE: m for m in MAPS}
BY_MODEL_TYPE = {m.MODEL_TYPE: m for m in MAPS}
FROM_FOLDER = ("data.seq_len", "data.tokenizer", "data.vocab_size", "data.prepared")


def pick_map(hf: dict, path: str):
    """The architecture map of a ``config.json``: by ``architectures``, else by ``model_type``."""
    archs = hf.get("architectures") or []
    if archs:
        if len(archs) != 1 or archs[0] not in BY_ARCHITECTURE:
            want = " or ".join(BY_ARCHITECTURE)
            raise refuse_import(path, "architectures", archs, f"lmforge imports {want}")
        return BY_ARCHITECTURE[archs[0]]
    kind = hf.get("model_type")
    if kind not in BY_MODEL_TYPE:
        raise refuse_import(path, "model_type", kind, f"lmforge imports {' or '.join(BY_MODEL_TYPE)}")
    return BY_MODEL_TYPE[kind]


def _tokenizer(hf_dir: Path, vocab_size: int, path: str) -> Tokenizer:
    try:
        tok = Tokenizer(hf_dir / "tokenizer.json")
    except DataError:
        raise UserError(
            f"HF_DIR: {hf_dir}/tokenizer.json is missing or has no {EOT} token; lmforge needs a tokenizers "
            "JSON file with it (its document separator)"
        ) from None
    if tok.vocab_size != vocab_size:
        raise refuse_import(
            path, "vocab_size", vocab_size, f"lmforge's vocabulary is the tokenizer's ({tok.vocab_size})"
        )
    return tok


def _check_shapes(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor], path: str) -> None:
    for name, value in want.items():
        if tuple(state[name].shape) != tuple(value.shape):
            raise UserError(
                f"{path}: tensor for {name} has shape {tuple(state[name].shape)}, config.json implies "
                f"{tuple(value.shape)}; the weights do not belong to this config"
            )


def _dotted(prefix: str, values: dict[str, Any]) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"prefix.a.b": 1}`` (the overrides ``load_config`` takes)."""
    out = {}
    for key, value in values.items():
        out.update(
            _dotted(f"{prefix}.{key}", value) if isinstance(value, dict) else {f"{prefix}.{key}": value}
        )
    return out


def import_config(hf_dir: Path, run_dir: Path, recipe: str | None, overrides: dict[str, Any]) -> Config:
    """The imported run's config: recipe and flags, with ``model.*`` and the context length from
    ``config.json`` and the run's copy of the tokenizer."""
    path = str(hf_dir / "config.json")
    hf = read_config(hf_dir)
    model, max_len = pick_map(hf, path).config_from_hf(hf, path)
    for key in overrides:
        if key.startswith("model.") or key in FROM_FOLDER:
            raise UserError(f"--{key}: comes from {path} and its tokenizer; drop the flag")
    tok = _tokenizer(hf_dir, int(hf["vocab_size"]), path)
    fixed = {
        **_dotted("model", model.model_dump(exclude_none=True)),
        "data.seq_len": max_len,
        "data.tokenizer": str((run_dir / "tokenizer.json").resolve()),
        "data.vocab_size": tok.vocab_size,
    }
    return load_config(recipe, {**overrides, **fixed})


def import_hf(
    hf_dir: str | Path,
    run_dir: str | Path,
    recipe: str | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Make ``run_dir`` an lmforge run of the Hugging Face folder ``hf_dir``; returns its checkpoint."""
    from lmforge.train.build import build_run  # the run's machinery: only once the inputs are checked
    from lmforge.train.launch import default_callbacks
    from lmforge.train.trainer import Trainer

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    if not hf_dir.is_dir():
        raise UserError(f"HF_DIR: {hf_dir} is not a folder; give a Hugging Face model folder")
    if latest_checkpoint(run_dir) is not None:
        raise UserError(f"--run-dir: {run_dir} already holds checkpoints; choose a new --run-dir")
    cfg = import_config(hf_dir, run_dir, recipe, overrides or {})
    path = str(hf_dir)
    state = pick_map(read_config(hf_dir), path).state_from_hf(read_weights(hf_dir), cfg.model, path)
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(hf_dir / "tokenizer.json", run_dir / "tokenizer.json")
    run = build_run(cfg)
    _check_shapes(state, run.model.state_dict(), path)
    with torch.no_grad():
        run.model.load_state_dict({k: v.to(run.device) for k, v in state.items()})
    toml = config_text(cfg, [f"# step 0: imported from {hf_dir.resolve()} (lmforge import)"])
    (run_dir / "config.toml").write_text(toml)
    trainer = Trainer(run, default_callbacks(cfg, run_dir, False, toml))
    saved = trainer.state_dict()
    saved["config"] = config_state(cfg)
    return save_checkpoint(run_dir, 0, saved, toml, cfg.train.keep_checkpoints).final
