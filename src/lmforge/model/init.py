"""Initialisation schemes.

Standard (GPT-2): every linear and embedding weight ~ N(0, std^2); the projections that write into the
residual stream (``o_proj``, ``down_proj``, ``fc_out``) ~ N(0, (std / sqrt(2 * n_layers))^2), so the
residual variance stays O(1) over depth; biases 0; norm weights 1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "fc_out")


def residual_std(std: float, n_layers: int) -> float:
    """``std / sqrt(2 * n_layers)``: two residual writes (attention, MLP) per block."""
    return std / math.sqrt(2 * n_layers)


@torch.no_grad()
def init_weights(model: nn.Module, std: float, n_layers: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            short = name.rsplit(".", 1)[-1]
            s = residual_std(std, n_layers) if short in RESIDUAL_OUTPUTS else std
            if module.weight is not getattr(getattr(model, "embed", None), "weight", None):
                nn.init.normal_(module.weight, 0.0, s)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
