"""``lmforge estimate`` from its inputs to its result, shared by the command and the web planners
(``web/pages/``), so a page shows exactly the figures ``lmforge estimate --json`` prints for the same
inputs. Overrides are given as the command line gives them (``--SECTION.KEY=VALUE``) and parsed by the same
code.

Unlike the rest of ``plan/`` this module sits above the measurements: ``--gpu cpu`` measures this host's
peak FLOP/s (``probes/peak_flops.py``) as a run's MFU does."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lmforge.errors import UserError
from lmforge.recipe import load_config, parse_overrides

MODEL_KEYS = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "bias")


@dataclass(frozen=True)
class EstimateRequest:
    """The inputs of ``lmforge estimate`` (its flags, and the overrides as ``--SECTION.KEY=VALUE``)."""

    recipe: str | None = None
    model: str | None = None
    gpu: str = "h100-80gb"
    gpus: int = 1
    weights: str = "lmforge"
    search: bool = False
    top: int = 10
    margin: float = 0.8
    mfu: float = 0.4
    attention: str | None = None
    overrides: tuple[str, ...] = ()


@dataclass
class EstimateResult:
    """What ``lmforge estimate`` computed: the estimate of the asked layout, the search's layouts (when
    asked), the fewest devices that fit (when the search found none), and what the text and plot name."""

    name: str
    cfg: Any
    hw: Any
    precision: str
    workload: Any
    estimate: Any
    found: list = field(default_factory=list)
    more: tuple | None = None

    def to_json(self, searched: bool) -> dict:
        """The object ``lmforge estimate --json`` prints."""
        out = {
            "model": self.name,
            "estimate": self.estimate.to_dict(),
            "search": [e.to_dict() for e in self.found],
        }
        if searched and not self.found:
            more = self.more
            out["fewest_devices"] = None if more is None else {"gpus": more[0], "estimate": more[1].to_dict()}
        return out


def estimate_inputs(req: EstimateRequest):
    """The recipe (a named size under the overrides), the device and the resolved precision; UserError
    naming the flag or key for bad input."""
    from lmforge.plan import hardware, models

    overrides = parse_overrides(list(req.overrides))
    if req.model is not None:
        try:
            named = models.get(req.model)
        except KeyError:
            raise UserError(
                f"--model: unknown size {req.model!r}; use one of {', '.join(models.MODELS)}"
            ) from None
        base: dict[str, Any] = {f"model.{k}": getattr(named.model, k) for k in MODEL_KEYS}
        base |= {
            "data.vocab_size": named.vocab_size,
            "data.seq_len": named.seq_len,
            "train.micro_batch_size": 1,
        }
        overrides = {**base, **overrides}
    cfg = load_config(req.recipe, overrides)
    if req.gpu not in hardware.NAMES:
        raise UserError(f"--gpu: unknown device {req.gpu!r}; use one of {', '.join(hardware.NAMES)}")
    from lmforge.probes.peak_flops import cpu_peak_flops

    hw = hardware.get(req.gpu, cpu_peak_flops() if req.gpu == "cpu" else None)
    check_modelled(cfg)
    precision = cfg.train.precision
    if precision == "auto":
        import torch

        from lmforge.precision import native_bf16

        precision = "bf16" if req.gpu != "cpu" or native_bf16(torch.device("cpu")) else "fp32"
    if precision not in hw.peak_flops:
        raise UserError(
            f"train.precision: {req.gpu} has no {precision} units; use --train.precision=bf16 (or a device "
            "with FP8: h100-80gb, h200)"
        )
    for flag, value, ok in (
        ("--gpus", req.gpus, req.gpus >= 1),
        ("--margin", req.margin, 0 < req.margin <= 1),
        ("--mfu", req.mfu, 0 < req.mfu <= 1),
    ):
        if not ok:
            raise UserError(
                f"{flag}: {value} is out of range; give "
                + ("an integer >= 1" if flag == "--gpus" else "a number in (0, 1]")
            )
    return cfg, hw, precision


def run_estimate(req: EstimateRequest) -> EstimateResult:
    """``lmforge estimate``'s computation for ``req`` (UserError for bad input, before any work)."""
    from lmforge.plan.activations import attention_kind
    from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
    from lmforge.plan.search import fewest_devices, search

    cfg, hw, precision = estimate_inputs(req)
    try:
        layout = layout_from_config(cfg, req.gpus)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_runnable(cfg, layout, req.gpus)
    device_type = "cpu" if hw.name == "cpu" else "cuda"
    attention = req.attention or attention_kind(device_type, cfg.train.attention, cfg.model.doc_mask)
    workload = workload_from_config(cfg, precision, attention, device_type)
    try:
        if cfg.train.micro_batch_size == "auto":
            layout = auto_micro_batch(cfg, layout, workload, hw, req)
        est = estimate(workload, layout, hw, req.weights, req.margin, req.mfu)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    found = search(workload, req.gpus, hw, req.weights, req.margin, req.mfu, req.top) if req.search else []
    more = None
    if req.search and not found:
        more = fewest_devices(workload, req.gpus, hw, req.weights, req.margin, req.mfu)
    name = req.model or (req.recipe or "default recipe")
    return EstimateResult(name, cfg, hw, precision, workload, est, found, more)


def estimate_json(req: EstimateRequest) -> dict:
    """Exactly the object ``lmforge estimate --json`` prints for ``req``."""
    return run_estimate(req).to_json(req.search)


def auto_micro_batch(cfg, layout, workload, hw, req: EstimateRequest):
    """``train.micro_batch_size = "auto"`` as ``lmforge train`` resolves it: the largest size splitting
    ``train.tokens_per_step`` whose estimate fits (else the smallest)."""
    from lmforge.plan.estimate import estimate
    from lmforge.plan.micro_batch import auto_candidates, largest

    parallel = cfg.parallel.model_copy(update={"dp_shard": layout.dp_shard})
    sizes = auto_candidates(cfg.model_copy(update={"parallel": parallel}))

    def fits(size: int) -> bool:
        return estimate(
            workload, replace(layout, micro_batch=size), hw, req.weights, req.margin, req.mfu
        ).fits

    return replace(layout, micro_batch=largest(sizes, fits) or sizes[-1])


# what the planner does not model, with the reason: ``lmforge estimate`` refuses it instead of a number
NOT_MODELLED = {
    "parallel.offload": (
        lambda cfg: cfg.parallel.offload,
        "FSDP2's CPU offload (the shards, gradients and optimizer states in host memory)",
    ),
    "train.activation_offload": (
        lambda cfg: cfg.train.activation_offload,
        "activations offloaded to host memory",
    ),
    "train.objective": (
        lambda cfg: cfg.train.objective == "dpo",
        "DPO (two sequences per pair and a reference model)",
    ),
    "train.precision": (
        lambda cfg: cfg.train.precision == "fp64",
        "float64 verification runs (8 bytes a value everywhere)",
    ),
    "train.activation_checkpointing": (
        lambda cfg: cfg.model.moe.experts > 0 and cfg.train.activation_checkpointing == "selective",
        "selective checkpointing of Mixture-of-Experts blocks (which of their ops it keeps)",
    ),
}


def check_modelled(cfg) -> None:
    """UserError, in one line naming the key, for a recipe the planner does not model (:data:`NOT_MODELLED`):
    its figures would count everything on the device, or one sequence per row, and be wrong."""
    for key, (on, what) in NOT_MODELLED.items():
        if on(cfg):
            raise UserError(
                f"{key}: the memory planner does not model {what}, so lmforge estimate gives no figures for "
                f"it; remove --{key} to plan the run without it"
            )


def check_runnable(cfg, layout, gpus: int) -> None:
    """What ``lmforge train`` would refuse of this layout, refused here with the same one line."""
    from lmforge.parallel.layout import check_layout
    from lmforge.parallel.model_layout import check_model_layout

    parallel = cfg.parallel.model_copy(update={"dp_shard": layout.dp_shard})
    planned = cfg.model_copy(update={"parallel": parallel})
    check_layout(planned, gpus, env={"WORLD_SIZE": str(gpus)})
    check_model_layout(planned)
