"""A run's model with integer linear layers (``lmforge export RUN --quantize SCHEME``,
``evaluate/quantized_export.py``), and its loader.

The checkpoint's plain model is quantized by torchao's post-training config of the scheme
(``model/qat.py::ptq_config``: the same grid, scales and dynamic activation quantization that QAT's fake
quantizers simulate) on the layers QAT targets, and written as a folder:

* ``model.pt``: the quantized model's ``state_dict`` (``torch.save``; each quantized weight a torchao
  ``IntxUnpackedToInt8Tensor``: int8 codes, one float scale per row and group, zero points), loadable
  with ``torch.load(weights_only=True)``;
* ``quantization.json``: scheme, group size, the quantized layers, the checkpoint step it came from;
* ``config.toml`` (the checkpoint's), ``tokenizer.json`` and a chat run's template.

:func:`load_quantized` builds the plain model without initialising it, applies the same torchao config
(so every quantized weight has the right tensor type) and loads the saved tensors into it
(``assign=True``). :func:`~lmforge.evaluate.run_loading.load_run` hands such a folder here, so
``lmforge generate`` and ``lmforge eval`` run the exported model as they run a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.model.qat import check_group_size, check_scheme, ptq_config, target_names
from lmforge.recipe import load_saved_config
from lmforge.tokenizer import Tokenizer

INFO = "quantization.json"
WEIGHTS = "model.pt"


def is_quantized_export(folder: str | Path) -> bool:
    """Whether ``folder`` is what ``export --quantize`` writes."""
    return (Path(folder) / INFO).is_file()


def quantize_model(model: nn.Module, scheme: str, group_size: int) -> list[str]:
    """Quantize ``model``'s QAT target layers in place with torchao's config of ``scheme``; returns their
    names. Refuses (user error) an unknown scheme or a group size that does not divide a layer's width."""
    from torchao.quantization import quantize_

    check_scheme(scheme, "--quantize")
    if group_size < 0:
        raise UserError(f"--group-size: {group_size} is negative; use a divisor of the layers' widths, or 0")
    check_group_size(model, group_size, "--group-size")
    names = set(target_names(model))
    quantize_(model, ptq_config(scheme, group_size), filter_fn=lambda _m, fqn: fqn in names)
    return sorted(names)


def load_quantized(folder: str | Path, device: torch.device) -> tuple[Config, Tokenizer, nn.Module, int]:
    """(config, tokenizer, quantized model, step) of an ``export --quantize`` folder."""
    from lmforge.train.build import build_model

    folder = Path(folder)
    try:
        info = json.loads((folder / INFO).read_text())
        scheme, group_size = info["scheme"], int(info["group_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise UserError(
            f"{folder / INFO}: not an lmforge quantization record; export the run again"
        ) from None
    cfg = load_saved_config(folder / "config.toml")
    tok = Tokenizer(folder / "tokenizer.json")
    model = build_model(cfg, tok.vocab_size, torch.device("cpu"), init=False, adapters=False).float()
    quantize_model(model, scheme, group_size)
    # weights_only: torchao (imported by quantize_model) allow-lists its tensor types for torch.load
    state = torch.load(folder / WEIGHTS, map_location="cpu", weights_only=True)
    model.load_state_dict(state, assign=True)
    return cfg, tok, model.to(device).eval(), int(info["step"])
