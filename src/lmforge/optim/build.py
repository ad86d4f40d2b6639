"""Parameter groups and the optimizer factory.

Weight decay applies to matrices of linear layers only; biases, norm weights and (unless
``optim.decay_embeddings``) token and position embeddings are not decayed. A tied output head shares
the embedding tensor and follows the embedding rule.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.lion import Lion

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0}]`` (empty ones dropped)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = id(p) in embeddings
        if p.ndim >= 2 and (not is_embedding or cfg.decay_embeddings):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The configured optimizer over :func:`param_groups` (weight decay only on decayed matrices)."""
    groups = param_groups(model, cfg)
    for g in groups:
        log.info(
            "optim: %s group, %d tensors, weight_decay=%g", g["name"], len(g["params"]), g["weight_decay"]
        )
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    if cfg.name == "lion":
        return Lion(groups, lr=cfg.lr, betas=cfg.betas)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")
