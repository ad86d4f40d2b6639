"""Parameter groups and the optimizer factory.

Every parameter has a kind: ``embedding`` (token / position embeddings, and a head tied to them),
``matrix`` (other weights with two or more dimensions), ``norm`` (norm weights) or ``bias``, and a depth:
0 for embeddings, ``i + 1`` for block ``i``, ``L + 1`` for the final norm and an untied head.

* Weight decay: ``optim.weight_decay`` on matrices (and on embeddings with ``optim.decay_embeddings``),
  0 elsewhere; ``optim.group_weight_decay`` overrides it per kind.
* Learning rate: ``lr * lr_mult`` with ``lr_mult = group_lr_mult[kind] * layer_lr_decay ^ (L + 1 - depth)``,
  so with layer-wise decay the output end trains at the full rate and each layer below at ``decay`` times
  the one above it.
* muP: a model with ``param_lr_scales()`` (name -> multiplier; see ``lmforge/model/init.py``) gets those
  multipliers on top, e.g. ``1 / width_mult`` for hidden matrices.

One optimizer group is made per (kind, depth, route, muP multiplier) when layer-wise decay is on,
else per (kind, route, muP multiplier).

With ``optim.name = "muon"`` each group is also marked with the optimizer that moves it: Muon takes the
hidden matrices (2-D weights inside blocks: the attention and MLP projections), AdamW everything else
(embeddings, an untied output head, norms, biases). Muon groups run at ``optim.muon.lr`` instead of ``lr``,
folded into their ``lr_mult`` so that schedules, per-kind multipliers and layer-wise decay still apply.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict

import torch
from torch import nn

from lmforge.config import OptimConfig
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.lion import Lion
from lmforge.optim.muon import MuonWithAdamW

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def param_kind(p: torch.Tensor, embeddings: set[int], norms: set[int]) -> str:
    """``embedding`` | ``norm`` | ``matrix`` | ``bias`` given the ids of embedding and norm weights."""
    if id(p) in embeddings:
        return "embedding"
    if id(p) in norms:
        return "norm"
    return "matrix" if p.ndim >= 2 else "bias"


def param_depth(name: str, kind: str, n_layers: int) -> int:
    """0 for embeddings, ``i + 1`` inside block ``i``, ``n_layers + 1`` for the final norm and head."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1)) + 1
    return 0 if kind == "embedding" else n_layers + 1


def muon_routed(name: str, p: torch.Tensor, kind: str) -> bool:
    """Whether Muon moves this parameter: a 2-D matrix inside a block (attention / MLP projections)."""
    return kind == "matrix" and p.ndim == 2 and _BLOCK.search(name) is not None


def muon_peak_lr(cfg: OptimConfig) -> float:
    """Muon's peak rate: ``optim.muon.lr``, else 0.02, or ``optim.lr`` for the moonlight scale."""
    if cfg.muon.lr is not None:
        return cfg.muon.lr
    return cfg.lr if cfg.muon.scale == "moonlight" else 0.02


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Optimizer groups with ``weight_decay``, ``lr``, ``lr_mult`` and a ``name`` (see the module docstring);
    with ``optim.name = "muon"`` also ``optimizer`` (``muon`` or ``adamw``)."""
    n_layers = len(getattr(model, "blocks", []))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norms = {id(m.weight) for m in model.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)}
    scales = model.param_lr_scales() if hasattr(model, "param_lr_scales") else {}
    buckets: dict[tuple[str, int, str, float], list[torch.Tensor]] = defaultdict(list)
    routed: dict[str, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        kind = param_kind(p, embeddings, norms)
        depth = param_depth(name, kind, n_layers) if cfg.layer_lr_decay != 1.0 else 0
        route = ""
        if cfg.name == "muon":
            route = "muon" if muon_routed(name, p, kind) else "adamw"
            routed[route].append((name, p))
        buckets[(kind, depth, route, scales.get(name, 1.0))].append(p)
    for route, named in routed.items():
        log.info("optim: %s", describe_route(route, named))
    groups = []
    for (kind, depth, route, scale), params in sorted(
        buckets.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2], kv[0][3])
    ):
        default_wd = (
            cfg.weight_decay if kind == "matrix" or (kind == "embedding" and cfg.decay_embeddings) else 0.0
        )
        mult = cfg.group_lr_mult.get(kind, 1.0) * scale
        if cfg.layer_lr_decay != 1.0:
            mult *= cfg.layer_lr_decay ** (n_layers + 1 - depth)
        if route == "muon":
            mult *= muon_peak_lr(cfg) / cfg.lr
        name = kind if cfg.layer_lr_decay == 1.0 else f"{kind}@{depth}"
        name = name if scale == 1.0 else f"{name}/mup"
        group = {
            "params": params,
            "weight_decay": cfg.group_weight_decay.get(kind, default_wd),
            "lr": cfg.lr * mult,
            "lr_mult": mult,
            "name": f"{name}/{route}" if route else name,
        }
        if route:
            group["optimizer"] = route
        groups.append(group)
    return groups


def describe_route(route: str, named: list[tuple[str, torch.Tensor]]) -> str:
    """One line: how many tensors go to ``route``, their shapes with counts, their names (block index as *)."""
    shapes = Counter("x".join(map(str, p.shape)) for _, p in named)
    names = dict.fromkeys(_BLOCK.sub(lambda m: m.group(0).replace(m.group(1), "*"), n) for n, _ in named)
    return (
        f"{route} moves {len(named)} tensors ({sum(p.numel() for _, p in named):,} values; "
        + ", ".join(f"{c} x {s}" for s, c in shapes.items())
        + "): "
        + ", ".join(names)
    )


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, compile: bool = True
) -> torch.optim.Optimizer:
    """The configured optimizer over :func:`param_groups` (weight decay only on decayed matrices).

    ``compile`` lets optimizers that compile their step (adamw8bit) do so; off, they run eagerly.
    """
    groups = param_groups(model, cfg)
    for g in groups:
        log.info(
            "optim: %s group, %d tensors, weight_decay=%g, lr_mult=%g",
            g["name"],
            len(g["params"]),
            g["weight_decay"],
            g["lr_mult"],
        )
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd.momentum, nesterov=cfg.sgd.nesterov)
    if cfg.name == "lion":
        return Lion(groups, lr=cfg.lr, betas=cfg.betas)
    if cfg.name == "adafactor":
        return Adafactor(groups, lr=cfg.lr, foreach=True)
    if cfg.name == "adamw8bit":
        from lmforge.optim.adamw8bit import AdamW8bit  # imports torchao (slow): only when chosen

        return AdamW8bit(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, compile=compile)
    if cfg.name == "muon":
        return MuonWithAdamW(
            groups,
            momentum=cfg.muon.momentum,
            nesterov=cfg.muon.nesterov,
            ns_steps=cfg.muon.ns_steps,
            scale=cfg.muon.scale,
            betas=cfg.betas,
            eps=cfg.eps,
            fused=fused,
        )
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")
