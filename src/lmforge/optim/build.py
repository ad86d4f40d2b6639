"""Parameter groups and the optimizer factory.

Every parameter has a kind: ``embedding`` (token / position embeddings, and a head tied to them),
``matrix`` (other weights with two or more dimensions), ``norm`` (norm weights) or ``bias``, and a depth:
0 for embeddings, ``i + 1`` for block ``i``, ``L + 1`` for the final norm and an untied head.

* Weight decay: ``optim.weight_decay`` on matrices (and on embeddings with ``optim.decay_embeddings``),
  0 elsewhere; ``optim.group_weight_decay`` overrides it per kind. By depth (``optim.depth_decay``) it is
  multiplied by ``first + (last - first) * depth / (L + 1)``: ``first`` at the embeddings, ``last`` at the
  final norm and head, linear over the blocks between (:func:`depth_decay_mult`). With
  ``optim.cautious_weight_decay`` a group's decay moves to its ``cautious_weight_decay`` key and its
  ``weight_decay`` is 0: ``optim/cautious.py`` applies it around the optimizer's step.
* Learning rate: ``lr * lr_mult`` with ``lr_mult = group_lr_mult[kind] * layer_lr_decay ^ (L + 1 - depth)``,
  so with layer-wise decay the output end trains at the full rate and each layer below at ``decay`` times
  the one above it.
* muP: a model with ``param_lr_scales()`` (name -> multiplier; see ``lmforge/model/init.py``) gets those
  multipliers on top, e.g. ``1 / width_mult`` for hidden matrices.
* Pipeline stages: ``L`` is the whole model's layer count (``model.cfg``), and an output head that holds a
  copy of a tied embedding (``tied_copies()``: a last stage without the embedding) is an ``embedding``, as
  the tied matrix is in one process.

One optimizer group is made per (kind, depth, route, muP multiplier) when layer-wise lr decay or depth
decay is on, else per (kind, route, muP multiplier).

With ``optim.name = "muon"`` each group is also marked with the optimizer that moves it: Muon takes the
hidden matrices (2-D weights inside blocks: the attention and MLP projections), AdamW everything else
(embeddings, an untied output head, norms, biases). Muon groups run at ``optim.muon.lr`` instead of ``lr``,
folded into their ``lr_mult`` so that schedules, per-kind multipliers and layer-wise decay still apply.
"""

from __future__ import annotations

import logging
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from lmforge.config import OptimConfig
from lmforge.optim.adafactor import Adafactor
from lmforge.optim.cautious import register_cautious_decay
from lmforge.optim.lion import Lion
from lmforge.optim.muon import MuonWithAdamW
from lmforge.optim.soap import SOAP

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


def expert_parallel_tag(p: torch.Tensor) -> str:
    """``ep`` for an expert-parallel expert (a DTensor on the ``ep`` mesh dimension), else empty: such
    parameters get groups of their own, as a fused optimizer step takes DTensors of one mesh only."""
    return "ep" if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep",) else ""


def depth_decay_mult(first: float, last: float, depth: int, n_layers: int) -> float:
    """``first + (last - first) * depth / (n_layers + 1)``: the weight-decay multiplier at ``depth`` (0: the
    embeddings, ``i + 1``: block ``i``, ``n_layers + 1``: the final norm and an untied head)."""
    return first + (last - first) * depth / (n_layers + 1)


def by_depth(cfg: OptimConfig) -> bool:
    """Whether groups are split by depth: layer-wise lr decay or weight decay by depth is on."""
    return cfg.layer_lr_decay != 1.0 or (cfg.depth_decay.first, cfg.depth_decay.last) != (1.0, 1.0)


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Optimizer groups with ``weight_decay``, ``lr``, ``lr_mult`` and a ``name`` (see the module docstring);
    with ``optim.name = "muon"`` also ``optimizer`` (``muon`` or ``adamw``)."""
    cfg_layers = getattr(getattr(model, "cfg", None), "n_layers", None)  # a pipeline stage: the whole model's
    n_layers = cfg_layers if cfg_layers is not None else len(getattr(model, "blocks", []))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    copies = model.tied_copies() if hasattr(model, "tied_copies") else {}  # a stage's copy of a tied matrix
    embeddings |= {id(p) for n, p in model.named_parameters() if n in copies}
    norms = {id(m.weight) for m in model.modules() if isinstance(m, nn.LayerNorm | nn.RMSNorm)}
    scales = model.param_lr_scales() if hasattr(model, "param_lr_scales") else {}
    buckets: dict[tuple[str, int, str, float, str], list[torch.Tensor]] = defaultdict(list)
    routed: dict[str, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        kind = param_kind(p, embeddings, norms)
        depth = param_depth(name, kind, n_layers) if by_depth(cfg) else 0
        route = ""
        if cfg.name == "muon":
            route = "muon" if muon_routed(name, p, kind) else "adamw"
            routed[route].append((name, p))
        buckets[(kind, depth, route, scales.get(name, 1.0), expert_parallel_tag(p))].append(p)
    for route, named in routed.items():
        log.info("optim: %s", describe_route(route, named))
    groups = []
    for (kind, depth, route, scale, ep), params in sorted(
        buckets.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2], kv[0][3], kv[0][4])
    ):
        default_wd = (
            cfg.weight_decay if kind == "matrix" or (kind == "embedding" and cfg.decay_embeddings) else 0.0
        )
        mult = cfg.group_lr_mult.get(kind, 1.0) * scale
        if cfg.layer_lr_decay != 1.0:
            mult *= cfg.layer_lr_decay ** (n_layers + 1 - depth)
        if route == "muon":
            mult *= muon_peak_lr(cfg) / cfg.lr
        name = f"{kind}@{depth}" if by_depth(cfg) else kind
        name = name if scale == 1.0 else f"{name}/mup"
        name = f"{name}/{ep}" if ep else name
        wd = cfg.group_weight_decay.get(kind, default_wd)
        wd *= (
            depth_decay_mult(cfg.depth_decay.first, cfg.depth_decay.last, depth, n_layers)
            if by_depth(cfg)
            else 1
        )
        group = {
            "params": params,
            "weight_decay": 0.0 if cfg.cautious_weight_decay else wd,
            "lr": cfg.lr * mult,
            "lr_mult": mult,
            "name": f"{name}/{route}" if route else name,
        }
        if route:
            group["optimizer"] = route
        if cfg.cautious_weight_decay:
            group["cautious_weight_decay"] = wd
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


def optimizer_factory(
    cfg: OptimConfig, device: torch.device, compile: bool = True
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The configured optimizer's class with its settings bound: ``make(groups)`` builds it over groups.

    Settings are bound here rather than given as group defaults so that a wrapper (ZeRO-1) hands the
    groups over unchanged: MuonWithAdamW must not see AdamW's ``eps`` in Muon's groups.
    """
    fused = cfg.fused if cfg.fused is not None else device.type in ("cuda", "cpu")
    if cfg.name == "adamw":
        return partial(torch.optim.AdamW, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "adam":
        return partial(torch.optim.Adam, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    if cfg.name == "sgd":
        return partial(torch.optim.SGD, lr=cfg.lr, momentum=cfg.sgd.momentum, nesterov=cfg.sgd.nesterov)
    if cfg.name == "lion":
        return partial(Lion, lr=cfg.lr, betas=cfg.betas)
    if cfg.name == "adafactor":
        return partial(Adafactor, lr=cfg.lr, foreach=True)
    if cfg.name == "adamw8bit":
        from lmforge.optim.adamw8bit import AdamW8bit  # imports torchao (slow): only when chosen

        return partial(AdamW8bit, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, compile=compile)
    if cfg.name == "muon":
        return partial(
            MuonWithAdamW,
            momentum=cfg.muon.momentum,
            nesterov=cfg.muon.nesterov,
            ns_steps=cfg.muon.ns_steps,
            scale=cfg.muon.scale,
            betas=cfg.betas,
            eps=cfg.eps,
            fused=fused,
        )
    if cfg.name == "soap":
        return partial(
            SOAP,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            shampoo_beta=cfg.soap.shampoo_beta,
            precondition_frequency=cfg.soap.precondition_frequency,
            max_precond_dim=cfg.soap.max_precond_dim,
        )
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def _logged_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    groups = param_groups(model, cfg)
    for g in groups:
        log.info(
            "optim: %s group, %d tensors, weight_decay=%g%s, lr_mult=%g",
            g["name"],
            len(g["params"]),
            g.get("cautious_weight_decay", g["weight_decay"]),
            " (cautious)" if "cautious_weight_decay" in g else "",
            g["lr_mult"],
        )
    return groups


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, compile: bool = True
) -> torch.optim.Optimizer:
    """The configured optimizer over :func:`param_groups` (weight decay only on decayed matrices).

    ``compile`` lets optimizers that compile their step (adamw8bit) do so; off, they run eagerly.
    Parameters may be plain tensors (one process, DDP) or DTensors sharded in any placements (FSDP2,
    tensor parallelism): every optimizer steps them exactly as one process steps the whole tensors.
    """
    optimizer = optimizer_factory(cfg, device, compile)(_logged_groups(model, cfg))
    register_cautious_decay(optimizer)
    return optimizer


def build_zero_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device: torch.device,
    compile: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> ZeroRedundancyOptimizer:
    """ZeRO-1: the configured optimizer wrapped in ``ZeroRedundancyOptimizer`` over ``process_group``
    (default: all ranks). Each rank keeps the state of, and steps, whole parameters (the largest first,
    each to the least loaded rank), then broadcasts them; the model is plain (DDP), not sharded.

    The groups keep their lmforge keys (``lr_mult``, ``name``, ``optimizer``): set ``lr`` on the
    wrapper's ``param_groups`` as usual, ZeRO copies it to the rank's optimizer before each step.

    Checkpoints: ``consolidate_state_dict(to=r)`` on every rank, then ``state_dict()`` on rank ``r`` gives
    an ordinary optimizer state dict (what :func:`build_optimizer`'s optimizer saves: a plain or ZeRO-1
    run loads it, exactly), which every rank passes to ``load_state_dict``.
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` does not take this wrapper (its
    ``state_dict`` needs the consolidation, on one rank only), nor its rank's inner optimizer (ranks hold
    empty groups, which the flattened state dict cannot load).
    """
    make = optimizer_factory(cfg, device, compile)
    optimizer = Zero1(_logged_groups(model, cfg), optimizer_class=make, process_group=process_group)
    register_cautious_decay(optimizer)  # after the broadcast: every rank decays the whole parameters
    return optimizer


class Zero1(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` whose ``load_state_dict`` leaves its argument alone and goes through the
    rank's optimizer's own ``load_state_dict``.

    torch's sets the entries of other ranks' parameters in the given dict to None (so the same dict cannot
    then be loaded again, or into anything else) and writes this rank's entries straight into the inner
    optimizer's ``state``, bypassing its ``load_state_dict``: AdamW8bit would keep the FP32 moments of the
    checkpoint instead of quantising them again. Here the dict is copied first, and the inner state is
    passed once through the inner optimizer's own load.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({**state_dict, "state": dict(state_dict["state"])})
        self.optim.load_state_dict(self.optim.state_dict())
