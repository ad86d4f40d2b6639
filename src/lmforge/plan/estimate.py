"""Memory, time and communication of one training layout on one kind of device (the search over layouts
is ``plan/search.py``). Pure: combines ``plan/memory.py``, ``plan/activations.py``, ``plan/comm.py`` and
``plan/flops.py``; nothing is allocated.

Per device (the largest pipeline rank; ``pp_rank_totals`` gives the total of every pipeline rank, whose
stages hold other layers and, under 1F1B, fewer micro-batches in flight)::

    total = params + grads + master + optimizer states + activations + temporaries + overhead
    overhead = runtime + fragmentation * (everything else)
    fits  <=>  total <= margin * device memory

``margin`` defaults to 0.8: Fujii et al. 2024 ("Accelerating Large Language Model Training with 4D
Parallelism and Memory Consumption Estimator") report no out-of-memory error in 454 runs whose estimate
stayed under 80% of device memory.

Activations: ``plan/activations.py`` for the rank's blocks, times the micro-batches in flight (GPipe
``m``; 1F1B and the others ``min(m, p - rank)``, Narayanan et al. 2021; interleaved schedules hold
somewhat more on the first rank, not modelled), plus one checkpointed block's recomputation.

Peak: activations coexist with the parameters, master weights, optimizer states and the backward
temporaries; the optimizer step's own scratch comes after the activations are freed. Gradients coexist
with the activations only when a step has more than one micro-batch (gradient accumulation, or several
pipeline micro-batches): ``train/step.py`` ends every step with ``zero_grad(set_to_none=True)``, so with
one micro-batch the backward starts with no gradient, and each layer's gradient appears as that layer's
activations are freed; activations plus gradients then peak at one end of the backward (linear in
between), at its start (all activations) or its end (all gradients, with the FSDP2 / DDP buffers)::

    several micro-batches:  total = states + overhead + max(activations + backward temporaries, step scratch)
    one micro-batch:        total = states - grads + overhead + max(activations + backward temporaries,
                                    grads + backward temporaries but the loss chunk, grads + step scratch)

(measured against PyTorch's FSDP memory tracker on real FSDP2 runs: tests/test_estimate_fsdp_tracker.py).
``peak_phase`` names the phase of the peak; ``gradients_at_peak``, ``activations_at_peak`` and
``temporaries_at_peak`` are its rows (they add up to the total).

Time (``mfu`` the model-FLOPs utilisation a plain layout reaches on this device, default 0.4 on GPUs: a
typical well-tuned dense run reaches 0.35-0.5 on A100/H100)::

    flops/step   = flops_per_token * tokens_per_step          (6N + 12 L d T, plan/flops.py)
    compute      = flops/step / (world * peak * mfu) * recompute / (1 - bubble)
    exposed comm = tp + pp volume / link  +  max(0, dp volume / link - compute)   (DP overlaps compute)
    step time    = compute + exposed comm

``recompute``: 1 (none), 1.03 (selective: Korthikanti et al. 2022 measured 2.7% extra), 1 + 1/(3K)
(``every:K``: one forward of every K-th block again, a forward being a third of forward + backward), 4/3
(full). ``bubble`` = ``(p - 1) / (v m + p - 1)`` (``parallel/pipeline.py``). The link is the device's
NVLink bandwidth inside a node of 8 and its network bandwidth (``node_link``) for groups that cross
nodes (mesh order ``(pp, dp_replicate, dp_shard, tp)``, ``tp`` innermost).

Chinchilla (Hoffmann et al. 2022): a compute-optimal run trains on ``D = 20 N`` tokens; the estimate
gives the days that takes at the estimated throughput.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

from lmforge.config import Config, ModelConfig
from lmforge.parallel.pipeline import (
    V_SHAPED,
    bubble_fraction,
    pipeline_settings,
    stage_ids,
    stage_layers,
)
from lmforge.plan.activations import activation_bytes
from lmforge.plan.comm import CommVolume, dp_volume, pp_volume, tied_volume, tp_volume
from lmforge.plan.flops import flops_per_token, lookup_params
from lmforge.plan.hardware import Hardware
from lmforge.plan.memory import (
    CPU_OVERHEAD,
    GPU_OVERHEAD,
    ParamTensor,
    StateBytes,
    Temporaries,
    compute_bytes,
    fsdp_shape,
    model_states,
    param_tensors,
    stage_tensors,
    temporaries,
    tp_shape,
)

GPUS_PER_NODE = 8
CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_MARGIN = 0.8
DEFAULT_MFU = 0.4
SELECTIVE_RECOMPUTE = 1.03
POLICIES = ("none", "selective", "every:2", "full")


@dataclass(frozen=True)
class Layout:
    """The ``parallel.*`` keys, micro-batch size and checkpointing policy of one run."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 3
    micro_batch: int = 1
    activation_checkpointing: str = "none"
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 0

    @property
    def world(self) -> int:
        """Devices: ``dp_replicate * dp_shard * tp * pp``."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def kind(self) -> str:
        """``none``, ``ddp``, ``zero1``, ``zero2`` or ``zero3`` (as ``parallel/layout.py`` decides)."""
        if self.dp_shard > 1:
            return f"zero{self.zero}"
        return "ddp" if self.dp_replicate > 1 else "none"

    def describe(self) -> str:
        """One line: kind, degrees above 1, micro-batch, checkpointing policy."""
        parts = [self.kind if self.kind != "none" else "1 device"]
        if self.dp > 1:
            parts.append(
                f"dp {self.dp_replicate}x{self.dp_shard}"
                if self.dp_replicate > 1 and self.dp_shard > 1
                else f"dp {self.dp}"
            )
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.pp > 1:
            parts.append(f"pp {self.pp}")
        parts.append(f"mb {self.micro_batch}")
        parts.append(f"ac {self.activation_checkpointing}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, its vocabulary and sequence length, precision, optimizer, the tokens
    of one optimizer step (None: one micro-batch per data-parallel rank), and the device type
    (``cuda`` / ``cpu``: which kernels, hence which saved tensors, ``plan/activations.py`` assumes)."""

    model: ModelConfig
    vocab_size: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    attention: str = "flash"
    loss_chunk: int = 1024
    tokens_per_step: int | None = None
    device_type: str = "cuda"


@dataclass(frozen=True)
class Estimate:
    """Every row of ``lmforge estimate`` for one layout (bytes per device; seconds; FLOPs)."""

    layout: Layout
    device: str
    accounting: str
    precision: str
    attention: str
    memory_bytes: float
    margin: float
    mfu: float
    n_params: int
    device_params: int
    pp_rank: int
    states: StateBytes
    activations: float
    activation_parts: dict[str, float]
    temporaries: Temporaries
    overhead: float
    overhead_runtime: float
    overhead_fraction: float
    overhead_note: str
    total: float
    peak_phase: str
    gradients_at_peak: float
    activations_at_peak: float
    temporaries_at_peak: float
    flops_per_token: float
    flops_per_step: float
    tokens_per_step: int
    accum: int
    bubble: float
    recompute: float
    comm: CommVolume
    compute_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    chinchilla_tokens: float
    chinchilla_days: float
    warnings: list[str] = field(default_factory=list)
    pp_rank_totals: list[float] = field(
        default_factory=list
    )  # total per pipeline rank (``pp_rank``'s is ``total``)

    @property
    def fits(self) -> bool:
        """``total <= margin * memory``."""
        return self.total <= self.margin * self.memory_bytes

    @property
    def tokens_per_day(self) -> float:
        """``tokens_per_s * 86400``."""
        return self.tokens_per_s * 86400

    @property
    def effective_mfu(self) -> float:
        """Model FLOPs over the step's peak: ``flops_per_step / (world * peak * step_s)`` = ``mfu *
        (1 - bubble) / recompute * compute_s / step_s``."""
        return (
            self.mfu * self.compute_s / self.step_s * (1 - self.bubble) / self.recompute
            if self.step_s
            else 0.0
        )

    def rows(self) -> dict[str, float]:
        """The memory breakdown at the peak (``peak_phase``), one entry per row of the table and bar of the
        chart; the rows add up to ``total``."""
        return {
            "parameters": self.states.params,
            "gradients": self.gradients_at_peak,
            "master weights": self.states.master,
            "optimizer states": self.states.optim,
            "activations": self.activations_at_peak,
            "temporaries": self.temporaries_at_peak,
            "overhead": self.overhead,
        }

    def to_dict(self) -> dict:
        """Every field (nested dataclasses as dicts) and the derived figures, for ``--json``."""
        out = asdict(self)
        out |= {
            "fits": self.fits,
            "tokens_per_day": self.tokens_per_day,
            "effective_mfu": self.effective_mfu,
            "states_total": self.states.total,
            "temporaries_total": self.temporaries.during_backward,
            "comm_total": self.comm.total,
            "layout_description": self.layout.describe(),
        }
        return out


def recompute_factor(policy: str) -> float:
    """Compute of a step relative to no checkpointing (module docstring)."""
    if policy == "none":
        return 1.0
    if policy == "selective":
        return SELECTIVE_RECOMPUTE
    if policy == "full":
        return 4 / 3
    k = int(policy.split(":")[1])
    return 1 + 1 / (3 * k)


def recomputed_forwards(policy: str) -> float:
    """Share of blocks whose forward runs twice (for the TP volume)."""
    if policy == "full":
        return 1.0
    if policy.startswith("every:"):
        return 1 / int(policy.split(":")[1])
    return 0.0


def accumulation(workload: Workload, layout: Layout) -> tuple[int, int]:
    """``(tokens_per_step, micro-batches per step)``: the step's tokens default to one micro-batch per
    data-parallel rank; ValueError when they do not split into whole micro-batches."""
    per = layout.micro_batch * workload.seq_len * layout.dp
    tokens = workload.tokens_per_step or per
    if tokens % per:
        raise ValueError(
            f"train.tokens_per_step: {tokens} is not a multiple of micro_batch * seq_len * dp = {per}"
        )
    return tokens, tokens // per


def _activations(
    workload: Workload, layout: Layout, stages: list[range], in_flight: int, mb: int, accounting: str
) -> tuple[float, dict]:
    """Saved activations plus one checkpointed block's recomputation (``ActivationBytes.peak``) of the
    ``in_flight`` pipeline micro-batches a rank holds over its ``stages``. The matmuls' saved 16-bit weight
    casts are left out where no cast happens: under FSDP2 the blocks compute with its gathered 16-bit
    parameters (counted as ``fsdp_gathered``), and in the zero-paper accounting parameters are 16-bit."""
    parts: dict[str, float] = {}
    for r in stages:
        a = activation_bytes(
            workload.model,
            workload.vocab_size,
            workload.seq_len,
            mb,
            layout.activation_checkpointing,
            compute_bytes(workload.precision),
            workload.attention,
            workload.loss_chunk,
            tp=layout.tp,
            layers=len(r),
            first_layer=r.start,
            device_type=workload.device_type,
        )
        for k, v in asdict(a).items():
            if k == "recompute":  # one block recomputes at a time on a rank, whatever is in flight
                parts[k] = max(parts.get(k, 0.0), float(v))
            else:
                parts[k] = parts.get(k, 0.0) + float(v) * in_flight
    if layout.kind in ("zero2", "zero3") or accounting == "zero-paper":
        parts["weight_casts"] = 0.0
    return sum(parts.values()), parts


def _link(hw: Hardware, span: int) -> float:
    return hw.link_bytes_per_s if span <= GPUS_PER_NODE else hw.node_link_bytes_per_s


def estimate(
    workload: Workload,
    layout: Layout,
    hw: Hardware,
    accounting: str = "lmforge",
    margin: float = DEFAULT_MARGIN,
    mfu: float = DEFAULT_MFU,
) -> Estimate:
    """The :class:`Estimate` of ``workload`` under ``layout`` on devices ``hw`` (module docstring)."""
    cfg = workload.model
    tensors = _param_tensors(cfg.model_dump_json(), workload.vocab_size, workload.seq_len)
    n_params = sum(t.numel for t in tensors)
    tokens, accum = accumulation(workload, layout)
    m, v = (1, 1)
    bubble = 0.0
    if layout.pp > 1:
        m, v = pipeline_settings(
            layout.pp, layout.pp_schedule, layout.pp_microbatches, layout.pp_stages_per_rank
        )
        bubble = bubble_fraction(layout.pp, m, v)
    if layout.micro_batch % m:
        raise ValueError(
            f"parallel.pp_microbatches: {m} pipeline micro-batches do not divide train.micro_batch_size "
            f"{layout.micro_batch}; set --train.micro_batch_size to a multiple of {m}"
        )
    pipe_mb = layout.micro_batch // m  # sequences of one pipeline micro-batch
    ranges = stage_layers(cfg.n_layers, layout.pp * v)
    kind, shards = layout.kind, layout.dp_shard
    c = compute_bytes(workload.precision)
    overhead_model = CPU_OVERHEAD if hw.name == "cpu" else GPU_OVERHEAD
    best = None
    rank_totals: list[float] = []
    for rank in range(layout.pp):
        owned = (
            [ranges[s] for s in stage_ids(rank, layout.pp, v, layout.pp_schedule)]
            if layout.pp > 1
            else ranges
        )
        in_flight = (
            1 if layout.pp == 1 else (m if layout.pp_schedule == "gpipe" else min(m, layout.pp - rank))
        )
        acts, parts = _activations(workload, layout, owned, in_flight, pipe_mb, accounting)
        loss_tokens = min(workload.loss_chunk or pipe_mb * workload.seq_len, pipe_mb * workload.seq_len)
        mine, states, temps = _device_states(
            cfg.model_dump_json(),
            workload.vocab_size,
            workload.seq_len,
            tuple((r.start, r.stop) for r in owned),
            kind,
            shards,
            layout.tp,
            workload.precision,
            workload.optimizer,
            loss_tokens,
            accounting,
        )
        # (phase, gradients, activations, temporaries) at each candidate peak (module docstring)
        if accum * m > 1:  # gradients accumulate over micro-batches: they coexist with the activations
            phases = [
                ("backward, gradients accumulating", states.grads, acts, temps.during_backward),
                ("optimizer step", states.grads, 0.0, temps.optimizer_step),
            ]
        else:  # one micro-batch: no gradient before its backward
            end_temps = max(temps.during_backward - temps.loss_chunk, temps.optimizer_step)
            phases = [
                ("start of backward (no gradients yet)", 0.0, acts, temps.during_backward),
                ("end of backward / optimizer step", states.grads, 0.0, end_temps),
            ]
        at_peak = max(phases, key=lambda ph: ph[1] + ph[2] + ph[3])
        allocated = states.total - states.grads + sum(at_peak[1:])
        overhead = overhead_model.runtime_bytes + overhead_model.fragmentation * allocated
        total = allocated + overhead
        rank_totals.append(total)
        if best is None or total > best[0]:
            best = (total, rank, mine, states, acts, parts, temps, overhead, at_peak)
    assert best is not None
    total, rank, mine, states, acts, parts, temps, overhead, at_peak = best
    device_params = sum(math.prod(tp_shape(t, layout.tp)) for t in mine)

    fpt = flops_per_token(n_params - lookup_params(tensors), cfg.n_layers, cfg.d_model, workload.seq_len)
    flops_step = fpt * tokens
    peak = hw.peak(workload.precision)
    recompute = recompute_factor(layout.activation_checkpointing)
    compute_s = flops_step / (layout.world * peak * mfu) * recompute / (1 - bubble)

    root = sum(math.prod(tp_shape(t, layout.tp)) for t in mine if t.unit == "root")
    device_tokens = tokens // layout.dp  # tokens through this device's layers per step
    comm = CommVolume(
        dp=dp_volume(
            kind,
            device_params,
            shards if kind.startswith("zero") else layout.dp,
            c,
            accum,
            root,
            layout.dp_replicate if kind.startswith("zero") else 1,
            accounting,
        ),
        tp=tp_volume(
            layout.tp,
            len({t.layer for t in mine if t.layer is not None}),
            device_tokens,
            cfg.d_model,
            workload.vocab_size,
            c,
            recomputed_forwards(layout.activation_checkpointing),
        ),
        pp=pp_volume(layout.pp, device_tokens, cfg.d_model, c) + tied_volume(_tied_grad_bytes(layout, mine)),
    )
    dp_s = comm.dp / _link(hw, layout.tp * layout.dp)
    other_s = comm.tp / _link(hw, layout.tp) + comm.pp / _link(hw, layout.world)
    exposed = other_s + max(0.0, dp_s - compute_s)
    step_s = compute_s + exposed
    tps = tokens / step_s
    chin = CHINCHILLA_TOKENS_PER_PARAM * n_params
    warnings = []
    if workload.precision == "fp8" and "fp8" not in hw.peak_flops:
        warnings.append(f"{hw.name} has no FP8 units")
    return Estimate(
        layout=layout,
        device=hw.name,
        accounting=accounting,
        precision=workload.precision,
        attention=workload.attention,
        memory_bytes=float(hw.memory_bytes),
        margin=margin,
        mfu=mfu,
        n_params=n_params,
        device_params=device_params,
        pp_rank=rank,
        states=states,
        activations=acts,
        activation_parts=parts,
        temporaries=temps,
        overhead=overhead,
        overhead_runtime=overhead_model.runtime_bytes,
        overhead_fraction=overhead_model.fragmentation,
        overhead_note=overhead_model.note,
        total=total,
        peak_phase=at_peak[0],
        gradients_at_peak=at_peak[1],
        activations_at_peak=at_peak[2],
        temporaries_at_peak=at_peak[3],
        flops_per_token=fpt,
        flops_per_step=flops_step,
        tokens_per_step=tokens,
        accum=accum,
        bubble=bubble,
        recompute=recompute,
        comm=comm,
        compute_s=compute_s,
        exposed_comm_s=exposed,
        step_s=step_s,
        tokens_per_s=tps,
        chinchilla_tokens=chin,
        chinchilla_days=chin / tps / 86400,
        warnings=warnings,
        pp_rank_totals=rank_totals,
    )


def _tied_grad_bytes(layout: Layout, mine: list[ParamTensor]) -> float:
    """FP32 gradient bytes of this rank's copy of a tied embedding that another pipeline rank also holds
    (``parallel/tied_embedding.py``: every schedule but the V-shaped one, where one rank holds both ends);
    0 elsewhere. Sharded as the parameter is (TP, then FSDP2's ``dp_shard``)."""
    if layout.pp == 1 or layout.pp_schedule in V_SHAPED:
        return 0.0
    emb = next((t for t in mine if t.name == "embed.weight" and t.linear), None)  # linear: tied to the head
    if emb is None:
        return 0.0
    shards = layout.dp_shard if layout.kind in ("zero2", "zero3") else 1
    return 4.0 * math.prod(fsdp_shape(tp_shape(emb, layout.tp), shards))


@functools.lru_cache(maxsize=4096)
def _device_states(
    model_json: str,
    vocab_size: int,
    seq_len: int,
    owned: tuple[tuple[int, int], ...],
    kind: str,
    shards: int,
    tp: int,
    number_format: str,
    optimizer: str,
    loss_tokens: int,
    accounting: str,
) -> tuple[list[ParamTensor], StateBytes, Temporaries]:
    """The tensors of a pipeline rank owning the block ranges ``owned``, their model states and the
    temporaries (the head's loss chunk on the rank owning the last block only); cached, since the layouts of a search
    that differ only in checkpointing or micro-batch share them."""
    tensors = _param_tensors(model_json, vocab_size, seq_len)
    n_layers = ModelConfig.model_validate_json(model_json).n_layers
    mine: list[ParamTensor] = []
    for start, stop in owned:
        have = {t.name for t in mine}
        mine += [t for t in stage_tensors(tensors, range(start, stop), n_layers) if t.name not in have]
    states = model_states(mine, kind, shards, tp, optimizer, accounting)
    has_head = any(stop == n_layers for _, stop in owned) and any(
        t.unit == "head" or (t.name == "embed.weight" and t.linear) for t in mine
    )
    temps = temporaries(
        mine if has_head else [t for t in mine if t.name != "lm_head.weight"],
        kind,
        shards,
        tp,
        number_format,
        optimizer,
        vocab_size,
        loss_tokens if has_head else 0,
        accounting,
    )
    return mine, states, temps


@functools.lru_cache(maxsize=8)
def _param_tensors(model_json: str, vocab_size: int, seq_len: int) -> list[ParamTensor]:
    """:func:`param_tensors`, once per model (a search estimates hundreds of layouts of one model)."""
    return param_tensors(ModelConfig.model_validate_json(model_json), vocab_size, seq_len)


def layout_from_config(cfg: Config, gpus: int | None = None) -> Layout:
    """The :class:`Layout` of a recipe's ``parallel.*`` and ``train.*`` keys; with ``gpus`` above 1 and
    every degree 1, all of them shard (``parallel.dp_shard = gpus``, lmforge's default ZeRO-3), as
    ``lmforge train`` suggests. ValueError when the degrees' product is not ``gpus``."""
    p = cfg.parallel
    layout = Layout(
        p.dp_replicate,
        p.dp_shard,
        p.tp,
        p.pp,
        p.zero,
        cfg.train.micro_batch_size,
        cfg.train.activation_checkpointing,
        p.pp_schedule,
        p.pp_microbatches,
        p.pp_stages_per_rank,
    )
    if gpus is not None and gpus > 1 and layout.world == 1:
        layout = replace(layout, dp_shard=gpus)
    if gpus is not None and layout.world != gpus:
        raise ValueError(
            f"--gpus: {gpus} devices, but the layout pp x dp_replicate x dp_shard x tp uses {layout.world}; "
            "make them agree"
        )
    return layout


def workload_from_config(
    cfg: Config, number_format: str, attention: str, device_type: str = "cuda"
) -> Workload:
    """The :class:`Workload` of a recipe, with ``train.precision`` already resolved to ``number_format``
    for the planned device (no ``PrecisionPolicy``: that one belongs to a device of this process)."""
    name = cfg.optim.name
    optimizer = "sgd0" if name == "sgd" and cfg.optim.sgd.momentum == 0 else name
    return Workload(
        cfg.model,
        cfg.data.vocab_size,
        cfg.data.seq_len,
        number_format,
        optimizer,
        attention,
        cfg.train.loss_chunk,
        cfg.train.tokens_per_step,
        device_type,
    )
