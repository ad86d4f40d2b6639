"""The files of a Hugging Face model folder: ``config.json``, safetensors weights (one file, or shards
named by ``model.safetensors.index.json``), and the tokenizer files ``AutoTokenizer`` reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from lmforge.errors import UserError
from lmforge.tokenizer import EOT

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_config(folder: Path) -> dict[str, Any]:
    """``folder/config.json``; missing or unreadable is the user's error."""
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"HF_DIR: {folder} has no config.json; give a Hugging Face model folder")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a JSON object; give a Hugging Face config.json")
    return value


def write_weights(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One ``model.safetensors`` (``format = pt``, which ``from_pretrained`` checks)."""
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, folder / WEIGHTS, {"format": "pt"})


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from None


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    if (folder / WEIGHTS).is_file():
        return _load(folder / WEIGHTS)
    if not (folder / INDEX).is_file():
        raise UserError(
            f"HF_DIR: {folder} has neither {WEIGHTS} nor {INDEX}; save the model with safe_serialization"
        )
    try:
        shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError) as exc:
        raise UserError(f"{folder / INDEX}: no weight_map ({exc}); give a complete index") from None
    out: dict[str, torch.Tensor] = {}
    for name in shards:
        if not (folder / name).is_file():
            raise UserError(f"{folder / INDEX}: names the shard {name}, which is missing")
        out.update(_load(folder / name))
    return out


def bos_processor(eot_id: int) -> processors.TemplateProcessing:
    """The post-processor that puts ``<|endoftext|>`` before a text (``lmforge generate`` prompts a plain run
    so: the document start of pretraining) and between the two texts of a pair (the document separator);
    the one ``transformers`` 5 builds itself from ``add_bos_token = true``."""
    return processors.TemplateProcessing(
        single=f"{EOT}:0 $A:0", pair=f"{EOT}:0 $A:0 {EOT}:1 $B:1", special_tokens=[(EOT, eot_id)]
    )


def write_tokenizer(
    folder: Path, tokenizer_json: Path, max_len: int, chat_template: str | None = None
) -> None:
    """``tokenizer.json`` (the run's own, with :func:`bos_processor` as its post-processor: encoding with
    special tokens, ``AutoTokenizer``'s default, adds the ``<|endoftext|>`` that ``lmforge generate`` puts
    before a prompt) with ``tokenizer_config.json`` and ``special_tokens_map.json`` naming lmforge's
    end-of-text token as the BOS and EOS token (``add_bos_token = true``, ``add_eos_token = false``); a
    chat run's template (Jinja, which writes its own ``<|endoftext|>``) as ``chat_template``."""
    tok = HFTokenizer.from_file(str(tokenizer_json))
    tok.post_processor = bos_processor(tok.token_to_id(EOT))
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": EOT, "eos_token": EOT}
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
            "add_bos_token": True,
            "add_eos_token": False,
            **({"chat_template": chat_template} if chat_template is not None else {}),
        },
    )
    write_json(folder / "special_tokens_map.json", special)
