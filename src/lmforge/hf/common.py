"""What both architectures' maps share: refusals, the muP check, the model keys a ``config.json`` gives."""

from __future__ import annotations

from typing import Any

from lmforge.config import ModelConfig
from lmforge.errors import UserError
from lmforge.model.init import width_mult


def refuse_export(field: str, value: Any, why: str) -> UserError:
    """The error of an lmforge setting that the Hugging Face class cannot express exactly."""
    return UserError(f"{field}: {value!r} cannot be exported to Hugging Face: {why}")


def refuse_import(path: str, field: str, value: Any, why: str) -> UserError:
    """The error of a ``config.json`` field that lmforge's model lacks."""
    return UserError(f"{path}: config.json field {field} = {value!r} is not supported: {why}")


Problem = tuple[str, Any, str]  # (config.json field, its value, why lmforge cannot read it and what it reads)


def refuse_fields(path: str, problems: list[Problem]) -> UserError:
    """The one-line error of every ``config.json`` field of ``problems`` that lmforge's model lacks, all of
    them named at once (a released configuration may have several)."""
    parts = [
        f"config.json field {field} = {value!r} is not supported: {why}" for field, value, why in problems
    ]
    return UserError(f"{path}: " + "; ".join(parts))


def check_mup(model: ModelConfig) -> None:
    """muP away from its base width scales logits by ``1 / width_mult`` and attention by ``1 / d_head``:
    neither Hugging Face class has such factors. At ``d_model = mup_base_width`` muP is the standard
    model (``lmforge/model/init.py``) and exports as it is."""
    if width_mult(model.d_model, model.mup_base_width, model.mup) != 1.0:
        raise refuse_export(
            "model.mup",
            model.mup,
            f"muP at d_model {model.d_model} != mup_base_width {model.mup_base_width} scales the logits "
            "by 1/width_mult and attention by 1/d_head, which the Hugging Face classes lack",
        )


def model_config(path: str, fields: dict[str, Any]) -> ModelConfig:
    """``model.*`` built from a ``config.json``'s values; an inconsistent one is the file's error."""
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        first = str(exc).splitlines()
        raise UserError(f"{path}: config.json does not make an lmforge model ({first[-1].strip()})") from None


def flag(hf: dict, key: str, default: Any) -> Any:
    """``hf[key]``, or ``default`` where the key is absent or null."""
    value = hf.get(key)
    return default if value is None else value


def take(tensors: dict, name: str, path: str) -> Any:
    """``tensors[name]``; a missing tensor is the folder's error."""
    if name not in tensors:
        raise UserError(f"{path}: the safetensors files have no tensor {name}; give a complete checkpoint")
    return tensors[name]
