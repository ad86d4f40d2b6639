"""``parallel.max_memory_gb``: a run whose planned per-device peak exceeds the memory it must fit is refused
before any work, with one line naming the key, the figures, the phase that sets the peak and the fix.

The planned peak is ``lmforge estimate``'s (``plan/estimate.py``, lmforge accounting): the larger of the
build's peak (the rank's FP32 shards and the largest whole parameter while the sharded build initialises
them; a whole replica under one process, DDP or ZeRO-1) and the training step's, the framework's
overhead included, for the pipeline rank where each is largest. The limit is the key, in GB (``1e9``
bytes), or, unset, the CUDA device's total memory; on a CPU without the key nothing is checked (processes
share the host's RAM, which the operating system also uses). No margin is taken off the limit: the check
refuses what the planner says cannot fit, and leaves the planner's uncertain last 20% (``lmforge estimate``'s
``--margin``) to the run.

What the plan assumes: the recipe's ``data.vocab_size`` (a trained tokenizer's own vocabulary may be
smaller), the language-model objective (DPO's two rows per pair and its reference model are not
counted), ``train.micro_batch_size = "auto"`` at its smallest candidate (the pipeline's micro-batches, or
1: what auto falls back to), ``train.precision = "auto"`` as the device resolves it, eager activations
(an upper bound of what a compiled run saves, ``docs/activation_memory.md``). Offloading to host memory
(``parallel.offload``, ``train.activation_offload``) is not modelled: such a run is not checked, and
refused in one line when the key asks for a check.

:func:`check_memory` is the pure function; :func:`check_run_memory` reads what it needs from this process
(``torchrun``'s world size, the CUDA device's memory, native BF16) and is what ``train/build.py::validate``
calls.
"""

from __future__ import annotations

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.parallel.pipeline import pipeline_settings
from lmforge.plan.activations import attention_kind
from lmforge.plan.estimate import Estimate, estimate, layout_from_config, workload_from_config
from lmforge.plan.hardware import Hardware, cpu

GB = 1e9
KEY = "parallel.max_memory_gb"
# what the planner does not model: no check with these on (offloading moves memory off the device; a
# float64 verification run holds 8 bytes a value where the plan counts 4)
NOT_PLANNED = {  # what the planner does not model (plan/request.py::NOT_MODELLED refuses it in estimate)
    "parallel.offload": lambda cfg: cfg.parallel.offload,
    "train.activation_offload": lambda cfg: cfg.train.activation_offload,
    "train.precision=fp64": lambda cfg: cfg.train.precision == "fp64",
    "train.activation_checkpointing=selective with model.moe": lambda cfg: (
        cfg.model.moe.experts > 0 and cfg.train.activation_checkpointing == "selective"
    ),
}


def planned_peak(cfg: Config, world: int, device_type: str, number_format: str) -> Estimate:
    """The estimate of ``cfg`` on ``world`` processes of ``device_type`` (``cuda`` / ``cpu``) computing in
    ``number_format`` (``train.precision`` resolved); ``Estimate.peak`` is the planned per-device peak,
    ``peak_source`` the phase that sets it. ``train.micro_batch_size = "auto"`` is planned at its smallest
    candidate. ValueError for a layout the planner cannot cut (``train/build.py`` refuses those first)."""
    train = cfg.train
    if train.micro_batch_size == "auto":
        p = cfg.parallel
        m = (
            pipeline_settings(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank)[0]
            if p.pp > 1
            else 1
        )
        cfg = cfg.model_copy(update={"train": train.model_copy(update={"micro_batch_size": m})})
    layout = layout_from_config(cfg, world)
    attention = attention_kind(device_type, cfg.train.attention, cfg.model.doc_mask)
    workload = workload_from_config(cfg, number_format, attention, device_type)
    if device_type == "cpu":
        hw = cpu(1.0)  # only memory matters here (the peaks and links are placeholders); the CPU's overhead
    else:
        hw = Hardware(device_type, 0, dict.fromkeys(("fp32", "tf32", "bf16", "fp16", "fp8"), 1.0), 1.0, 1.0)
    return estimate(workload, layout, hw)


def refusal(peak: Estimate, limit: float, source: str) -> str:
    """The one line of a refused layout: the key, the planned peak and its phase against the limit, and the
    fix for that phase."""
    if peak.peak_source == "build":
        phase = "the build (its FP32 parameters and the largest whole parameter while initialising them)"
        fix = (
            "shard the model over more ranks: a larger --parallel.dp_shard (FSDP2, --parallel.zero=2 or 3), "
            "or --parallel.tp / --parallel.pp"
        )
    else:
        phase = f"a training step [{peak.peak_phase}]"
        fix = (
            "shard more (a larger --parallel.dp_shard), checkpoint activations "
            "(--train.activation_checkpointing=full) or lower --train.micro_batch_size"
        )
    return (
        f"{KEY}: the planned peak per device is {peak.peak / GB:.2f} GB, set by {phase}, over the limit of "
        f"{limit / GB:.2f} GB ({source}); {fix} (lmforge estimate shows the breakdown)"
    )


def check_memory(
    cfg: Config, world: int, device_type: str, number_format: str, device_memory: int | None = None
) -> Estimate | None:
    """The planned peak of ``cfg`` (:func:`planned_peak`) checked against ``parallel.max_memory_gb`` (GB),
    or, unset, ``device_memory`` (bytes; a CUDA device's); ConfigError (:func:`refusal`) when it exceeds
    the limit. None when there is no limit (CPU without the key) or the run is one the planner does not
    model (:data:`NOT_PLANNED`: offloading to host memory, float64, selective checkpointing of MoE blocks;
    with the key set, a
    ConfigError): nothing is planned."""
    offload = [k for k, on in NOT_PLANNED.items() if on(cfg)]
    if offload and cfg.parallel.max_memory_gb is not None:
        raise ConfigError(
            f"{KEY}: the planner does not model {offload[0]}, so it cannot check the limit; remove {KEY} "
            f"or --{offload[0]}"
        )
    if offload:
        return None
    if cfg.parallel.max_memory_gb is not None:
        limit, source = cfg.parallel.max_memory_gb * GB, KEY
    elif device_memory is not None:
        limit, source = float(device_memory), f"the device's memory; {KEY} is unset"
    else:
        return None
    try:
        peak = planned_peak(cfg, world, device_type, number_format)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if peak.peak > limit:
        raise ConfigError(refusal(peak, limit, source))
    return peak


def check_run_memory(cfg: Config, device) -> Estimate | None:
    """:func:`check_memory` for this process's run on ``device`` (a ``torch.device``): the world size
    ``torchrun`` set, a CUDA device's total memory, ``train.precision = "auto"`` resolved as the run will
    (BF16 where native, else FP32)."""
    if cfg.parallel.max_memory_gb is None and device.type != "cuda":
        return None
    import torch

    from lmforge.parallel.layout import launch_env
    from lmforge.precision import native_bf16

    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    number_format = cfg.train.precision
    if number_format == "auto":
        number_format = "bf16" if native_bf16(device) else "fp32"
    return check_memory(cfg, launch_env()[2], device.type, number_format, memory)
