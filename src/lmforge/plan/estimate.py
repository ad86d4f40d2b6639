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
somewhat more on the first rank, not modelled), plus one checkpointed block's recomputation. The
split-backward schedules (``zero_bubble``, ``zbv``) are walked action by action in torch's own order
instead (:func:`split_backward_peak`): an input backward keeps its micro-batch's activations and the
gradients its weight backward needs until that runs, and several wait at once.

Peak: the largest of the step's phases (:func:`step_phases`: the loss's forward and backward, the last
and the first block's backward, the end of backward, the optimizer step), each the bytes alive in it as
PyTorch allocates and frees them: the parameters, master weights and optimizer states throughout, and the
phase's gradients, activations and temporaries::

    total = states - grads + overhead + max over phases (gradients + activations + temporaries alive)

(measured against PyTorch's MemTracker and FSDPMemTracker on real runs: tests/test_estimate_phases.py,
tests/test_estimate_fsdp_tracker.py). ``peak_phase`` names the phase of the peak; ``gradients_at_peak``,
``activations_at_peak`` and ``temporaries_at_peak`` are its rows (they add up to the total; as PyTorch's
trackers split them, the buffers the forward allocates, the loss's, are activations: :class:`Phase`),
``temporaries_alive`` its temporaries by :class:`~lmforge.plan.memory.Temporaries` field,
``forward_buffers_alive`` those of them counted as activations, and
``phase_totals`` every phase's bytes (overhead left out).

Time (``mfu`` the model-FLOPs utilisation a plain layout reaches on this device, default 0.4 on GPUs: a
typical well-tuned dense run reaches 0.35-0.5 on A100/H100)::

    flops/step   = flops_per_token * tokens_per_step          (6N + 12 L d T, plan/flops.py)
    compute      = flops/step / (world * peak * mfu) * recompute / (1 - bubble)
    exposed comm = tp + pp + ep volume / link  +  max(0, dp volume / link - compute)   (DP overlaps compute;
                   expert parallelism's all-to-alls, plan/comm.py::ep_volume, do not)
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
    SPLIT_BACKWARD,
    V_SHAPED,
    bubble_fraction,
    pipeline_settings,
    schedule_order,
    stage_ids,
    stage_layers,
)
from lmforge.plan.activations import TRANSIENT, activation_bytes, split_backward_bytes
from lmforge.plan.comm import (
    CommVolume,
    all_reduce,
    dp_collectives,
    dp_volume,
    ep_volume,
    pp_volume,
    tied_volume,
    tp_volume,
)
from lmforge.plan.flops import model_flops_per_token
from lmforge.plan.hardware import Hardware
from lmforge.plan.memory import (
    CPU_OVERHEAD,
    GPU_OVERHEAD,
    BuildBytes,
    Overhead,
    ParamTensor,
    StateBytes,
    Temporaries,
    active_param_count,
    build_bytes,
    compute_bytes,
    data_parallel,
    expert_parallel,
    fsdp_shape,
    model_buffer_bytes,
    model_states,
    moe_blocks,
    optimizer_key,
    param_tensors,
    stage_tensors,
    temporaries,
    tp_shape,
)

GIB = 2**30
GPUS_PER_NODE = 8
CHINCHILLA_TOKENS_PER_PARAM = 20
DEFAULT_MARGIN = 0.8
DEFAULT_MFU = 0.4
SELECTIVE_RECOMPUTE = 1.03
LOOKUPS = ("embed.weight", "pos_embed.weight")  # read by index: their gradients come last in backward
POLICIES = ("none", "selective", "every:2", "full")


@dataclass(frozen=True)
class Layout:
    """The ``parallel.*`` keys, micro-batch size and checkpointing policy of one run (``defer_grad_sync``:
    ``parallel.defer_grad_sync``)."""

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
    defer_grad_sync: bool = False
    ep: int = 1  # parallel.ep: each MoE layer's routed experts split over ep of the data-parallel ranks

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
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
        parts.append(f"mb {self.micro_batch}")
        parts.append(f"ac {self.activation_checkpointing}")
        if self.defer_grad_sync:
            parts.append("deferred grad sync")
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, its vocabulary and sequence length, precision, optimizer, the tokens
    of one optimizer step (None: one micro-batch per data-parallel rank), the device type (``cuda`` /
    ``cpu``: which kernels, hence which saved tensors, ``plan/activations.py`` assumes) and the loss
    (``fused``: lmforge's fused linear + cross-entropy; ``chunked``: ``model/loss.py``'s
    ``ChunkedCrossEntropy``; ``plan/activations.py``). ``nesterov`` (None: lmforge's default for the
    optimizer) and ``weight_decay`` (whether matrices decay) shape the optimizer step's scratch
    (``plan/memory.py::optimizer_step_bytes``)."""

    model: ModelConfig
    vocab_size: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    attention: str = "flash"
    loss_chunk: int = 1024
    tokens_per_step: int | None = None
    device_type: str = "cuda"
    loss: str = "fused"
    nesterov: bool | None = None
    weight_decay: bool = True


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
    active_params: int  # parameters a token uses (all but the routed experts it is not sent to)
    device_params: int
    pp_rank: int
    states: StateBytes
    buffers: float  # the model's buffers on every rank: the RoPE tables (model_buffer_bytes)
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
    build: BuildBytes  # the build's peak on ``build_pp_rank`` (lmforge accounting, before overhead)
    build_overhead: float
    build_total: float  # ``build.total + build_overhead``
    build_pp_rank: int
    dp_collectives: dict[str, int]  # per step and FSDP2 unit (DDP: for all gradients); comm.dp_collectives
    warnings: list[str] = field(default_factory=list)
    pp_rank_totals: list[float] = field(default_factory=list)  # the step's total per pipeline rank
    pp_rank_build_totals: list[float] = field(default_factory=list)  # the build's total per pipeline rank
    temporaries_alive: dict[str, float] = field(default_factory=dict)  # Temporaries fields alive at the peak
    # Temporaries fields made in the forward and alive at the peak: in the activations row (Phase)
    forward_buffers_alive: dict[str, float] = field(default_factory=dict)
    phase_totals: dict[str, float] = field(default_factory=dict)  # each phase's allocated bytes, no overhead

    @property
    def peak(self) -> float:
        """The planned per-device peak: the larger of the training step's (``total``) and the build's."""
        return max(self.total, self.build_total)

    @property
    def peak_source(self) -> str:
        """``build`` when initialising the model sets the peak, else ``step``."""
        return "build" if self.build_total > self.total else "step"

    @property
    def fits(self) -> bool:
        """``peak <= margin * memory``."""
        return self.peak <= self.margin * self.memory_bytes

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
        chart; the rows add up to ``total``. The parameters row holds the model's buffers too (``buffers``:
        the RoPE tables)."""
        return {
            "parameters": self.states.params + self.buffers,
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
            "peak": self.peak,
            "peak_source": self.peak_source,
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


def checkpointed(policy: str, index: int) -> bool:
    """Whether block ``index`` recomputes in backward: every block under ``full`` and ``selective``, those
    with ``index % K == 0`` under ``every:K`` (``parallel/apply.py``'s rule)."""
    if policy in ("full", "selective"):
        return True
    return policy.startswith("every:") and index % int(policy.split(":")[1]) == 0


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
    workload: Workload, layout: Layout, pipe: _Pipeline, rank: int, accounting: str
) -> tuple[float, dict, int, float | None, float]:
    """Saved activations of the pipeline micro-batches pipeline rank ``rank`` holds at once over its
    stages (:meth:`_Pipeline.held`; returned too: the most of one stage, under an interleaved schedule
    the saved bytes held once every gradient exists, else None, and the bytes of every send of the step,
    alive at its end under an interleaved schedule, else 0), plus
    the larger of the two transients on top of them (``ActivationBytes.peak``): one checkpointed block's
    recomputation (in backward) or autocast's cached weight casts (at the end of one forward); each is
    per forward or per block, so counted once whatever is in flight.

    Under ZeRO-2/3 with a 16-bit precision the blocks run under FSDP2's ``MixedPrecisionPolicy``
    (``parallel/data_parallel.py::apply_fsdp``; FP8 too, whose policy computes in BF16): 16-bit parameters
    and residual stream, no weight casts (the gathered 16-bit parameters are counted as
    ``fsdp_gathered``); one process, DDP and ZeRO-1 autocast over FP32 parameters. In the zero-paper
    accounting parameters are 16-bit, so no weight cast is counted either."""
    c = compute_bytes(workload.precision)
    fsdp_mp = layout.kind in ("zero2", "zero3") and c < 4
    parts: dict[str, float] = {}
    stages = pipe.owned(layout, rank)
    per_stage = []
    for r in stages:
        a = activation_bytes(
            workload.model,
            workload.vocab_size,
            workload.seq_len,
            pipe.micro_batch,
            layout.activation_checkpointing,
            c,
            workload.attention,
            workload.loss_chunk,
            tp=layout.tp,
            layers=len(r),
            first_layer=r.start,
            device_type=workload.device_type,
            loss=workload.loss,
            fsdp_mixed_precision=fsdp_mp,
            fp8=workload.precision == "fp8",
            ep=layout.ep,
        )
        per_stage.append(a)
    # a stage's output, kept by the pipeline stage for its backward (nothing in the stage saves it): the
    # residual stream of a micro-batch, on every stage but the one ending with the head
    out_bytes = (
        (c if fsdp_mp else 4) * pipe.micro_batch * workload.seq_len * workload.model.d_model / layout.tp
    )
    outputs = [0.0 if r.stop == workload.model.n_layers or layout.pp == 1 else out_bytes for r in stages]
    # what a finished backward's sends keep alive under the interleaved schedules (until the step ends):
    # the stage's output, sent forward, and its input's gradient (the residual stream's size), sent back
    kept = [o + (0.0 if r.start == 0 else out_bytes) for r, o in zip(stages, outputs, strict=True)]
    counts, with_grads, sent, sent_later = pipe.held(
        layout, rank, [a.total + o for a, o in zip(per_stage, outputs, strict=True)], kept
    )
    parts["stage_output"] = float(sum(o * n for o, n in zip(outputs, counts, strict=True)))
    parts["pipeline_sends"] = sent
    later = (
        float(sum(a.total * n for a, n in zip(per_stage, with_grads, strict=True))) + sent_later
        if with_grads
        else None
    )
    for a, count in zip(per_stage, counts, strict=True):
        for k, v in asdict(a).items():
            if k in TRANSIENT:  # one block recomputes, one forward's autocast cache lives, at a time
                parts[k] = max(parts.get(k, 0.0), float(v))
            else:
                parts[k] = parts.get(k, 0.0) + float(v) * count
    if accounting == "zero-paper":
        parts["weight_casts"] = parts["forward_casts"] = 0.0
    saved = sum(v for k, v in parts.items() if k not in TRANSIENT)
    sends_at_end = pipe.m * sum(kept) if sent or sent_later else 0.0
    return saved + max(parts[k] for k in TRANSIENT), parts, max(counts), later, sends_at_end


def _link(hw: Hardware, span: int) -> float:
    return hw.link_bytes_per_s if span <= GPUS_PER_NODE else hw.node_link_bytes_per_s


@dataclass(frozen=True)
class _Pipeline:
    """How the layout cuts a micro-batch and the model: ``m`` pipeline micro-batches per micro-batch of
    ``micro_batch * m`` sequences, ``v`` stages per rank, the blocks of each stage, the ideal bubble."""

    m: int
    v: int
    micro_batch: int
    ranges: list[range]
    bubble: float

    def owned(self, layout: Layout, rank: int) -> list[range]:
        """The block ranges of pipeline rank ``rank`` (every stage without a pipeline)."""
        if layout.pp == 1:
            return self.ranges
        return [self.ranges[s] for s in stage_ids(rank, layout.pp, self.v, layout.pp_schedule)]

    def in_flight(self, layout: Layout, rank: int) -> int:
        """Pipeline micro-batches whose activations rank ``rank`` holds at once (GPipe ``m``; 1F1B and the
        others ``min(m, p - rank)``)."""
        if layout.pp == 1:
            return 1
        return self.m if layout.pp_schedule == "gpipe" else min(self.m, layout.pp - rank)

    def held(
        self, layout: Layout, rank: int, sizes: list[float], kept: list[float]
    ) -> tuple[list[int], list[int] | None, float, float]:
        """Pipeline micro-batches of each of rank ``rank``'s stages whose activations it holds at once
        (``sizes``: one micro-batch's saved bytes of each stage), at most and once every gradient exists
        (None: one micro-batch's, as under 1F1B), and the bytes of finished backwards' sends still alive at
        each of the two moments (``kept``: per backward of each stage): :meth:`in_flight` of every stage
        and nothing kept, but under the interleaved schedules (:func:`interleaved_held`)."""
        if layout.pp == 1 or self.v == 1 or layout.pp_schedule in V_SHAPED:
            return [self.in_flight(layout, rank)] * len(sizes), None, 0.0, 0.0
        factor = 2 if layout.pp_schedule == "interleaved_1f1b" else 1
        best, with_grads, best_done, with_grads_done = interleaved_held(
            layout.pp, self.v, self.m, rank, factor, sizes, kept
        )

        def sent(done: list[int]) -> float:
            return float(sum(d * k for d, k in zip(done, kept, strict=True)))

        return best, with_grads, sent(best_done), sent(with_grads_done)


def interleaved_held(
    p: int, v: int, m: int, rank: int, factor: int, sizes: list[float], kept: list[float] | None = None
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Micro-batches held per local stage by rank ``rank`` of an interleaved schedule (``p`` ranks, ``v``
    stages each, ``m`` micro-batches) at the moment its bytes are largest, following the order torch's
    schedules run (``torch.distributed.pipelining``, interleaved 1F1B with ``factor`` 2, interleaved zero
    bubble with 1): ``mpr = m / max(1, m // p)`` micro-batches a round; the rank first runs
    ``W = min((v - 1) mpr + factor (p - 1 - rank), m v)`` forwards, then alternates one forward and one
    backward. Forward ``i`` runs local stage ``(i // mpr) mod v``, backward ``j`` local stage
    ``v - 1 - (j // mpr) mod v``.

    The bytes of a moment: ``sum_s held_s sizes_s + sum_s done_s kept_s``, ``sizes``: one micro-batch's
    saved bytes of each local stage; ``kept``: what each finished backward of a local stage leaves alive
    until the step ends, ``done_s`` the backwards finished so far. These schedules run on torch's
    schedule runtime, which waits for its sends only at the end of the step, and a send's work holds its
    tensor: the stage's output sent forward, its input's gradient sent back.

    Returned: the holding at the largest moment, the holding at the largest moment once every local stage
    has had a backward (from then on all of the rank's gradients exist beside the activations; the rank
    keeps about ``W`` micro-batches in flight until its last forward), and the backwards finished at each
    of the two. (One stage per rank, 1F1B, holds ``min(m, p - rank)``, :meth:`_Pipeline.in_flight`, and
    one micro-batch at its last backward.)"""
    kept = kept or [0.0] * v
    mpr = m // max(1, m // p)
    total = m * v
    forwards = [(i // mpr) % v for i in range(total)]
    backwards = [v - 1 - (j // mpr) % v for j in range(total)]
    held, finished = [0] * v, [0] * v
    done = min((v - 1) * mpr + factor * (p - 1 - rank), total)
    for s in forwards[:done]:
        held[s] += 1
    best, best_done = list(held), [0] * v
    with_grads, with_grads_done = [0] * v, [0] * v

    def size(h: list[int], f: list[int]) -> float:
        return sum(n * b + d * k for n, b, d, k in zip(h, sizes, f, kept, strict=True))

    for j in range(total):
        if done < total:
            held[forwards[done]] += 1
            done += 1
        if size(held, finished) > size(best, best_done):
            best, best_done = list(held), list(finished)
        if all(finished) and size(held, finished) > size(with_grads, with_grads_done):
            with_grads, with_grads_done = list(held), list(finished)
        held[backwards[j]] -= 1
        finished[backwards[j]] += 1
    return best, with_grads, best_done, with_grads_done


@dataclass(frozen=True)
class SplitStage:
    """One local stage of a split-backward schedule (:func:`split_backward_peak`), per micro-batch:
    ``saved`` its saved activations (with its input and output), ``retained`` what its input backward
    ``I`` adds until its weight backward ``W``, ``left`` what a finished micro-batch leaves alive until
    the step ends; ``tensors`` the names of its parameters (whose gradients its first ``W`` makes);
    ``first``, ``last``: it holds block 0 (its ``I`` runs nothing, its ``W`` the whole backward), the
    head and the loss."""

    saved: float
    retained: float
    left: float
    tensors: frozenset[str]
    first: bool = False
    last: bool = False


def split_backward_peak(
    actions: list[tuple],
    stages: dict[int, SplitStage],
    grad_bytes: dict[str, float],
    transients: dict[str, float],
    gradients_from_start: bool = False,
    constant: dict[str, float] | None = None,
) -> tuple[str, float, float, dict[str, float]]:
    """The largest moment of one pipeline rank's split-backward schedule (``zero_bubble``, ``zbv``), action
    by action in torch's order (``actions``: :func:`~lmforge.parallel.pipeline.schedule_order`'s for the
    rank): ``(name, gradients, activations, temporaries)``.

    Each micro-batch of a stage is in one of three states: forwarded (``saved``), input gradient made
    and its weight backward waiting (``saved + retained``: ``I`` keeps the graph for ``W``), or finished
    (``left``: its sends and receive buffers, alive until the step ends). A stage's gradients exist from
    its first ``W`` (``B`` where the table has a whole backward) on; with ``gradients_from_start``
    (accumulation over micro-batches of ``train.tokens_per_step``) from the start. ``grad_bytes``: each
    parameter's gradient bytes. The bytes of a moment, for the action::

        F   after it, + the loss's forward buffers on the stage with the loss
        I   before it, + the loss's backward buffers (the stage with the loss); after it, + the input
              backward's working set + a checkpointed block's recomputation
        W   before it (nothing freed yet), + the gradients it makes the first time, + on the first stage
              the whole backward's working set and a recomputation
        B   as W, then the micro-batch is finished

    ``transients``: ``loss_forward``, ``loss_backward``, ``input_backward``, ``block_backward`` (one
    block's whole backward), ``recompute``; ``constant``: temporaries alive throughout, by
    :class:`~lmforge.plan.memory.Temporaries` field (DDP's buckets, FSDP2's gathered copies). Measured against ``StoragePeak`` action by action (``tests/test_split_backward.py``,
    ``benchmarks/planner_accuracy.py``'s ``pp2-zero-bubble-*`` and ``pp2-zbv-*``)."""
    forwarded = dict.fromkeys(stages, 0)
    waiting = dict.fromkeys(stages, 0)
    finished = dict.fromkeys(stages, 0)
    made: set[str] = set(grad_bytes) if gradients_from_start else set()
    t = transients

    def held() -> float:
        return sum(
            forwarded[s] * st.saved + waiting[s] * (st.saved + st.retained) + finished[s] * st.left
            for s, st in stages.items()
        )

    def grads(names: set[str]) -> float:
        return sum(grad_bytes.get(n, 0.0) for n in names)

    best: tuple[str, float, float, dict[str, float]] = ("", 0.0, 0.0, {})

    def moment(name: str, g: float, acts: float, temps: dict[str, float]) -> None:
        nonlocal best
        temps = {k: v for k, v in ((constant or {}) | temps).items() if v}
        if g + acts + sum(temps.values()) > best[1] + best[2] + sum(best[3].values()):
            best = (name, g, acts, temps)

    for stage, kind, mb in actions:
        st = stages[stage]
        if kind == "F":
            forwarded[stage] += 1
            loss = {"loss_forward": t.get("loss_forward", 0.0)} if st.last else {}
            moment(f"forward: stage {stage}, micro-batch {mb}", grads(made), held(), loss)
        elif kind == "I":
            name = f"backward: stage {stage}'s input gradient, micro-batch {mb}"
            if st.last:  # the loss's backward comes first, before the stage's retained gradients exist
                moment(
                    f"{name}, the loss", grads(made), held(), {"loss_backward": t.get("loss_backward", 0.0)}
                )
            forwarded[stage] -= 1
            waiting[stage] += 1
            work = 0.0 if st.first else t.get("input_backward", 0.0)
            recompute = 0.0 if st.first else t.get("recompute", 0.0)
            moment(f"{name}, {sum(waiting.values())} weight backward(s) waiting", grads(made), held() + recompute,
                   {"block_backward": work})  # fmt: skip
        else:  # W, or B: a whole backward
            made |= st.tensors
            whole = st.first or kind == "B"
            temps = {"block_backward": t.get("block_backward", 0.0) if whole else 0.0}
            if kind == "B" and st.last and t.get("loss_backward", 0.0) > temps["block_backward"]:
                temps = {"loss_backward": t["loss_backward"]}
            recompute = t.get("recompute", 0.0) if whole else 0.0
            what = "weight gradients" if kind == "W" else "backward"
            moment(
                f"backward: stage {stage}'s {what}, micro-batch {mb}", grads(made), held() + recompute, temps
            )
            (waiting if kind == "W" else forwarded)[stage] -= 1
            finished[stage] += 1
    return best


def _pipeline(workload: Workload, layout: Layout) -> _Pipeline:
    m, v, bubble = 1, 1, 0.0
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
    ranges = stage_layers(workload.model.n_layers, layout.pp * v)
    return _Pipeline(m, v, layout.micro_batch // m, ranges, bubble)


@dataclass(frozen=True)
class _RankMemory:
    """One pipeline rank's memory: the training step's peak :class:`Phase` and total, each phase's
    allocated bytes (states included, overhead not), and the build's."""

    rank: int
    mine: list[ParamTensor]
    states: StateBytes
    buffers: float
    activations: float
    parts: dict
    temps: Temporaries
    overhead: float
    at_peak: Phase
    total: float
    build: BuildBytes
    build_overhead: float
    phase_totals: dict[str, float]

    @property
    def build_total(self) -> float:
        return self.build.total + self.build_overhead


def accumulating_gradients(
    states: StateBytes, mine: list[ParamTensor], layout: Layout, accounting: str
) -> float:
    """Gradient bytes while micro-batches accumulate: FSDP2's sharded gradients (``states.grads``), or the
    unsharded ones of the rank's TP/PP part (FP32 in lmforge's accounting) where FSDP2 keeps them
    unsharded until the step's last backward: ``parallel.defer_grad_sync``, and any pipeline stage (the
    schedule does so over its pipeline micro-batches)."""
    if layout.kind not in ("zero2", "zero3") or not (layout.defer_grad_sync or layout.pp > 1):
        return states.grads
    per_value = 4 if accounting == "lmforge" else 2
    return float(per_value * sum(math.prod(tp_shape(t, layout.tp)) for t in mine))


@dataclass(frozen=True)
class Phase:
    """One moment of a training step on one rank: its gradient and activation bytes and the temporaries
    alive in it, by :class:`~lmforge.plan.memory.Temporaries` field (the model states' other rows are
    alive throughout). ``forward_buffers``: the temporaries (by field) the forward allocates and that are
    alive in this phase, the loss's forward buffers; PyTorch's trackers count whatever is allocated
    outside the backward and the optimizer step as an activation (``MemTracker``'s and
    ``FSDPMemTracker``'s ACT), so :attr:`activations_row` holds them and the temporaries row does not."""

    name: str
    gradients: float
    activations: float
    temporaries: dict[str, float]
    forward_buffers: dict[str, float] = field(default_factory=dict)

    @property
    def activations_row(self) -> float:
        """``activations + sum(forward_buffers)``: the activations row as the trackers count it."""
        return self.activations + sum(self.forward_buffers.values())

    @property
    def total(self) -> float:
        """``gradients + activations + sum(forward_buffers) + sum(temporaries)``."""
        return self.gradients + self.activations_row + sum(self.temporaries.values())


def _gathered(temps: Temporaries, kind: str, pipeline: bool) -> tuple[float, ...]:
    """FSDP2's gathered parameter bytes in the loss's forward, the loss's backward, the last block's
    backward, the first block's and at the end of backward (:func:`step_phases`)."""
    if kind not in ("zero2", "zero3"):
        return 0.0, 0.0, 0.0, 0.0, 0.0
    root, head, unit = temps.fsdp_root, temps.fsdp_head, temps.fsdp_unit
    if pipeline:  # nothing resharded until the step's gradients are reduced
        return (temps.fsdp_gathered,) * 5
    # in forward the last all-gather's buffer (one unit) is still held when the loss runs
    if kind == "zero2":  # gathered from forward to each unit's backward, then resharded
        every = temps.fsdp_gathered
        return every + unit, every, every, root + unit, root
    return root + head + unit, root + head + unit, root + 2 * unit, root + unit, root


def _alive(temps: Temporaries, **kw: float) -> dict[str, float]:
    """The temporaries ``kw`` (by field) and DDP's buckets, those not 0."""
    return {k: v for k, v in ({"ddp_buckets": temps.ddp_buckets} | kw).items() if v}


def _head_and_last_block(
    temps: Temporaries,
    g: float,
    held: float,
    name: str,
    gathered: tuple[float, float, float],
    freed: float,
    recompute: float,
    forward_casts: float = 0.0,
) -> list[Phase]:
    """The loss's forward and backward (on the rank holding the head) and the last block's backward, with
    ``g`` gradient bytes and ``held`` saved activations (:func:`step_phases`); ``gathered``: FSDP2's
    gathered bytes in each, ``freed`` the head's and loss's activations, ``recompute`` the last block's,
    ``forward_casts`` autocast's cached weight copies, alive until the forward (the loss's included)
    ends."""
    fwd, bwd, last = gathered
    out = []
    if temps.loss_chunk:
        out += [
            Phase(
                "forward: head and loss" + name,
                g,
                held + forward_casts,
                _alive(temps, fsdp_gathered=fwd),
                {"loss_forward": temps.loss_forward} if temps.loss_forward else {},
            ),
            Phase(
                "backward: head and loss" + name,
                g,
                held,
                _alive(temps, fsdp_gathered=bwd, loss_backward=temps.loss_backward),
            ),
        ]
    recomputing = ", a checkpointed block recomputing" if recompute else ""
    last_block = _alive(temps, fsdp_gathered=last, block_backward=temps.block_backward)
    return [*out, Phase("backward: last block" + recomputing + name, g, held - freed + recompute, last_block)]


def _variants(
    saved: float,
    accumulating: float,
    micro_batches: int,
    rounds: int,
    in_flight: int,
    with_gradients: float | None = None,
) -> list[tuple[float, float, str]]:
    """``(gradients, saved activations, name)`` of the step's first backward (of its last micro-batch
    round) and, with pipeline micro-batches, of its last micro-batch (every gradient, one micro-batch's
    activations: :func:`step_phases`; ``with_gradients``: an interleaved schedule's, which keeps more)."""
    first = accumulating if rounds > 1 else 0.0
    if micro_batches <= rounds:
        return [(first, saved, "")]
    name = f", {in_flight} micro-batches in flight" if in_flight > 1 else ""
    if with_gradients is not None:
        return [(first, saved, name), (accumulating, with_gradients, ", every gradient made")]
    return [(first, saved, name), (accumulating, saved / in_flight, ", the last micro-batch")]


def step_phases(
    states: StateBytes,
    parts: dict[str, float],
    temps: Temporaries,
    micro_batches: int,
    accumulating: float,
    kind: str = "none",
    pipeline: bool = False,
    in_flight: int = 1,
    blocks: int = 1,
    block_grads: float = 0.0,
    rounds: int = 1,
    last_checkpointed: bool = True,
    with_gradients: float | None = None,
    sends: float = 0.0,
) -> list[Phase]:
    """The phases of a training step of ``micro_batches`` (micro-batches times pipeline micro-batches) on
    one rank, in the order PyTorch allocates and frees them (``parts``: the activation parts of
    ``_activations``, ``in_flight`` pipeline micro-batches; ``accumulating``: the gradient bytes while
    micro-batches accumulate, :func:`accumulating_gradients`; ``kind``: the layout's; ``rounds``: the
    step's micro-batches of ``train.tokens_per_step``, each split in pipeline micro-batches). ``A`` the
    saved activations (every part but the transients ``recompute`` and ``forward_casts``), ``G`` the
    gradients at the step's first backward of its last round (0 with one round: each step ends with
    ``zero_grad(set_to_none=True)``; else ``accumulating``), ``B`` DDP's buckets (alive throughout),
    FSDP2's gathered copies as ZeRO-3 holds them (root ``R``, untied head ``H``, largest block ``U``;
    ZeRO-2 and a pipeline stage keep every unit gathered), ``K`` an interleaved schedule's sends of the
    whole step, alive until it ends (:func:`interleaved_held`)::

        forward: head and loss   G + A + autocast's cached weight casts + B + R + H + U (the last
                                   all-gather's buffer) + loss forward buffers (in the activations
                                   row, as the trackers count them: :class:`Phase`)
        backward: head and loss  G + A + B + R + H + U (the next block prefetched) + loss backward buffers
        backward: last block     G + A - (head + loss) / in_flight + recompute + B + R + 2 U
                                   + one block's backward working set W
        backward: first block    G' + A_1 + recompute + B + R + U + one unit's reduce-scatter buffers S + W
                                   + the step's sends K
        end of backward          grads + B + R + S + tied copies + K
        optimizer step           grads + B + the step's scratch

    The loss's kept gradients (precomputing) are activations of the first two; its buffers and the head's
    saved tensors are freed before the blocks' backward, where a checkpointed block recomputes (the last
    block when it is checkpointed, ``last_checkpointed``; under ``every:K`` otherwise a lower one, once a
    block at least as large has freed its activations: then no recompute is added there); the first
    reduce-scatter starts after the last block's backward has freed that block's activations. Between the
    last block's backward and the first's (``blocks`` on this rank), activations fall and gradients grow
    block by block, so the larger end is the peak: at the first block's, ``A_1`` is one block's saved
    activations (``(A - head - loss - embedding) / (in_flight * blocks)`` plus the embedding's) and ``G'``
    every gradient but ``block_grads``: that block's and the untied lookups' (made last; outside FSDP2)
    (while accumulating, ``G``); under checkpointing, whose saved activations are small, this end is the
    larger. A pipeline rank holding
    ``in_flight`` micro-batches at its first backward has every gradient but one micro-batch's activations
    at its last (1F1B and GPipe alike; the last rank holds one, but a micro-batch's gradients at its
    second), so the loss and last-block phases come twice: ``G`` with ``A``, and
    ``accumulating`` with ``A / in_flight`` (interleaved: ``with_gradients``, :func:`interleaved_held`).
    A rank without the head has no loss phases. Measured: ``tests/test_estimate_phases.py``."""
    accumulating_suffix = (
        ", unsharded gradients accumulating" if accumulating != states.grads else ", gradients accumulating"
    )
    saved = sum(v for k, v in parts.items() if k not in TRANSIENT)
    freed = (parts.get("head", 0.0) + parts.get("loss", 0.0)) / in_flight
    fwd, bwd, last, first, end = _gathered(temps, kind, pipeline)
    recompute = parts.get("recompute", 0.0)
    recomputing = ", a checkpointed block recomputing" if recompute else ""
    recompute_last, casts = (recompute if last_checkpointed else 0.0), parts.get("forward_casts", 0.0)

    out = []
    for g, held, name in _variants(saved, accumulating, micro_batches, rounds, in_flight, with_gradients):
        name += accumulating_suffix if g else ""
        out += _head_and_last_block(temps, g, held, name, (fwd, bwd, last), freed, recompute_last, casts)
    embedding = parts.get("embedding", 0.0) / in_flight
    kept = saved - parts.get("pipeline_sends", 0.0)
    one_block = (kept - in_flight * freed - in_flight * embedding) / (in_flight * max(blocks, 1)) + embedding
    suffix = accumulating_suffix if micro_batches > 1 else ""
    out += [
        Phase(
            "backward: first block" + recomputing + suffix,
            accumulating if micro_batches > 1 else max(states.grads - block_grads, 0.0),
            one_block + recompute + sends,
            _alive(
                temps,
                fsdp_gathered=first,
                fsdp_grad_reduce=temps.fsdp_grad_reduce,
                block_backward=temps.block_backward,
            ),
        ),
        Phase(
            "end of backward",
            max(states.grads, accumulating) if micro_batches > 1 else states.grads,
            sends,
            _alive(
                temps, fsdp_gathered=end, fsdp_grad_reduce=temps.fsdp_grad_reduce, tied_grads=temps.tied_grads
            ),
        ),
        Phase("optimizer step", states.grads, 0.0, _alive(temps, optimizer_step=temps.optimizer_step)),
    ]
    return out


@functools.lru_cache(maxsize=64)
def _schedule_actions(pp: int, schedule: str, m: int, v: int, rank: int) -> tuple[tuple, ...]:
    """:func:`~lmforge.parallel.pipeline.schedule_order` of one rank, once per shape (a search plans
    hundreds of layouts)."""
    return tuple(schedule_order(pp, schedule, m, v)[rank])


def _split_phases(
    workload: Workload,
    layout: Layout,
    pipe: _Pipeline,
    rank: int,
    mine: list[ParamTensor],
    temps: Temporaries,
    accumulating: float,
    accum: int,
    recompute: float,
) -> tuple[Phase, float]:
    """The largest moment of pipeline rank ``rank``'s split-backward schedule (:func:`split_backward_peak`
    over torch's own action table) as a :class:`Phase`, and what the step's finished micro-batches leave
    alive at its end. A stage's micro-batch leaves, until the step ends, every residual-stream-sized
    tensor that crossed to or from another stage (its received input, its sent output, the received
    gradient of its output, the sent gradient of its input) and, on the last stage, its output, which the
    schedule keeps to merge the outputs (measured: 1, 4 and 3 of them on the first, a middle and the last
    stage); ``I`` sends its input's gradient."""
    c = compute_bytes(workload.precision)
    fsdp_mp = layout.kind in ("zero2", "zero3") and c < 4
    n_layers = workload.model.n_layers
    out = (c if fsdp_mp else 4) * pipe.micro_batch * workload.seq_len * workload.model.d_model / layout.tp
    stages: dict[int, SplitStage] = {}
    owned = pipe.owned(layout, rank)
    ids = stage_ids(rank, layout.pp, pipe.v, layout.pp_schedule)
    whole = _param_tensors(workload.model.model_dump_json(), workload.vocab_size, workload.seq_len)
    for s, r in zip(ids, owned, strict=True):
        first, last = r.start == 0, r.stop == n_layers
        kw = {"tp": layout.tp, "layers": len(r), "first_layer": r.start, "loss": workload.loss}
        a = activation_bytes(
            workload.model, workload.vocab_size, workload.seq_len, pipe.micro_batch,
            layout.activation_checkpointing, c, workload.attention, workload.loss_chunk,
            device_type=workload.device_type, fsdp_mixed_precision=fsdp_mp,
            fp8=workload.precision == "fp8", ep=layout.ep, **kw,
        )  # fmt: skip
        retained, _ = split_backward_bytes(
            workload.model, workload.vocab_size, workload.seq_len, pipe.micro_batch, c,
            fsdp_mixed_precision=fsdp_mp, **kw,
        )  # fmt: skip
        saved = a.total + (0.0 if last else out)
        names = frozenset(t.name for t in stage_tensors(whole, r, n_layers))
        left = out * (1 if first else 3 if last else 4)
        stages[s] = SplitStage(saved, retained + (0.0 if first else out), left, names, first, last)
    _, input_backward = split_backward_bytes(
        workload.model, workload.vocab_size, workload.seq_len, pipe.micro_batch, c, layout.tp,
        1, min(1, n_layers - 1),
    )  # fmt: skip
    local = {t.name: math.prod(tp_shape(t, layout.tp)) for t in mine}
    total = max(sum(local.values()), 1)
    grad_bytes = {name: accumulating * n / total for name, n in local.items()}
    constant = _alive(temps, fsdp_gathered=_gathered(temps, layout.kind, True)[0])
    transients = {
        "loss_forward": temps.loss_forward,
        "loss_backward": temps.loss_backward,
        "input_backward": input_backward,
        "block_backward": temps.block_backward,
        "recompute": recompute,
    }
    actions = _schedule_actions(layout.pp, layout.pp_schedule, pipe.m, pipe.v, rank)
    name, g, acts, alive = split_backward_peak(actions, stages, grad_bytes, transients, accum > 1, constant)
    suffix = ", gradients accumulating" if accum > 1 else ""
    return Phase(name + suffix, g, acts, alive), pipe.m * sum(st.left for st in stages.values())


def _rank_memory(
    workload: Workload,
    layout: Layout,
    pipe: _Pipeline,
    rank: int,
    accum: int,
    accounting: str,
    overhead_model: Overhead,
) -> _RankMemory:
    """The memory of pipeline rank ``rank``: its step's peak phase and its build."""
    owned = pipe.owned(layout, rank)
    acts, parts, in_flight, with_gradients, sends = _activations(workload, layout, pipe, rank, accounting)
    tokens = pipe.micro_batch * workload.seq_len
    model_json = workload.model.model_dump_json()
    mine, states, temps = _device_states(
        model_json,
        workload.vocab_size,
        workload.seq_len,
        tuple((r.start, r.stop) for r in owned),
        layout.kind,
        layout.dp_shard,
        layout.tp,
        workload.precision,
        workload.optimizer,
        min(workload.loss_chunk or tokens, tokens),
        accounting,
        workload.loss,
        layout.pp > 1,
        tokens,
        workload.nesterov,
        workload.weight_decay,
        layout.ep,
    )
    accumulating = accumulating_gradients(states, mine, layout, accounting)
    local = [math.prod(tp_shape(t, layout.tp)) for t in mine]
    per_block: dict[int, int] = {}
    for t, n in zip(mine, local, strict=True):
        if t.layer is not None:
            per_block[t.layer] = per_block.get(t.layer, 0) + n
    block_grads = states.grads * max(per_block.values(), default=0) / max(sum(local), 1)
    lookups = sum(n for t, n in zip(mine, local, strict=True) if t.name in LOOKUPS and not t.linear)
    late_grads = 0.0 if layout.kind in ("zero2", "zero3") else states.grads * lookups / max(sum(local), 1)
    phases = step_phases(
        states,
        parts,
        temps,
        accum * pipe.m,
        accumulating,
        layout.kind,
        layout.pp > 1,
        in_flight,
        len(per_block),
        block_grads + late_grads,
        accum,
        checkpointed(layout.activation_checkpointing, max(r.stop for r in owned) - 1),
        with_gradients,
        sends,
    )
    if layout.pp > 1 and layout.pp_schedule in SPLIT_BACKWARD:  # the schedule's own order, action by action
        split, left = _split_phases(
            workload, layout, pipe, rank, mine, temps, accumulating, accum, parts.get("recompute", 0.0)
        )
        ends = [replace(ph, activations=left) if ph.name == "end of backward" else ph for ph in phases[-2:]]
        phases = [split, *ends]
    at_peak = max(phases, key=lambda ph: ph.total)  # the first of equal phases
    buffers = model_buffer_bytes(workload.model, workload.seq_len)
    base = states.total - states.grads + buffers
    allocated = base + at_peak.total
    overhead = overhead_model.runtime_bytes + overhead_model.fragmentation * allocated
    whole = expert_parallel(_param_tensors(model_json, workload.vocab_size, workload.seq_len), layout.ep)
    build = build_bytes(whole, mine, layout.kind, layout.dp_shard, layout.tp)
    build_overhead = overhead_model.runtime_bytes + overhead_model.fragmentation * build.total
    return _RankMemory(
        rank,
        mine,
        states,
        buffers,
        acts,
        parts,
        temps,
        overhead,
        at_peak,
        allocated + overhead,
        build,
        build_overhead,
        {ph.name: base + ph.total for ph in phases},
    )


def _communication(
    workload: Workload,
    layout: Layout,
    pipe: _Pipeline,
    peak: _RankMemory,
    tokens: int,
    accum: int,
    accounting: str,
) -> tuple[CommVolume, dict[str, int]]:
    """Bytes per step of data, tensor and pipeline parallelism for the rank ``peak``, and the data-parallel
    collectives per step (``plan/comm.py``)."""
    kind, tp, c = layout.kind, layout.tp, compute_bytes(workload.precision)
    device_params = sum(math.prod(tp_shape(t, tp)) for t in peak.mine if data_parallel(t))
    experts_local = sum(math.prod(tp_shape(t, tp)) for t in peak.mine if not data_parallel(t))
    root = sum(math.prod(tp_shape(t, tp)) for t in peak.mine if t.unit == "root")
    sharded = kind.startswith("zero")
    pipeline_mb = pipe.m if layout.pp > 1 else 1
    device_tokens = tokens // layout.dp  # tokens through this device's layers per step
    n_layers = workload.model.n_layers
    comm = CommVolume(
        dp=dp_volume(
            kind,
            device_params,
            layout.dp_shard if sharded else layout.dp,
            c,
            accum,
            root,
            layout.dp_replicate if sharded else 1,
            accounting,
            layout.defer_grad_sync,
            pipeline_mb,
            layout.pp_schedule,
        )
        + all_reduce(4.0 * experts_local, layout.dp // layout.ep),
        tp=tp_volume(
            tp,
            len({t.layer for t in peak.mine if t.layer is not None}),
            device_tokens,
            workload.model.d_model,
            workload.vocab_size,
            c,
            recomputed_forwards(layout.activation_checkpointing),
            head=any(r.stop == n_layers for r in pipe.owned(layout, peak.rank)),
            loss=workload.loss,
        ),
        pp=pp_volume(layout.pp, device_tokens, workload.model.d_model, c)
        + tied_volume(_tied_grad_bytes(layout, peak.mine)),
        ep=_ep_volume(workload, layout, device_tokens),
    )
    counts = dp_collectives(kind, accum, layout.defer_grad_sync, pipeline_mb, layout.pp_schedule)
    return comm, counts


def _ep_volume(workload: Workload, layout: Layout, device_tokens: int) -> float:
    """Expert parallelism's all-to-all bytes per step for this rank (``plan/comm.py::ep_volume``): the
    rows dispatched in the residual stream's dtype (FP32, or the compute dtype under FSDP2's mixed
    precision), returned in the compute dtype."""
    m, c = workload.model, compute_bytes(workload.precision)
    mp = layout.kind in ("zero2", "zero3") and c < 4
    return ep_volume(
        layout.ep,
        len(moe_blocks(m)),
        device_tokens,
        m.moe.top_k,
        m.d_model,
        m.moe.experts,
        c if mp else 4,
        c,
        1.0 + recomputed_forwards(layout.activation_checkpointing),
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


def _warnings(workload: Workload, hw: Hardware, build: _RankMemory, step: _RankMemory) -> list[str]:
    out = []
    if workload.precision == "fp8" and "fp8" not in hw.peak_flops:
        out.append(f"{hw.name} has no FP8 units")
    if build.build_total > step.total:
        b = build.build
        out.append(
            f"the build sets the peak, not training: {build.build_total / GIB:.2f} GiB per device while the "
            f"model is initialised (FP32 parameters {b.shards / GIB:.2f}, the largest whole parameter "
            f"{b.temporary / GIB:.2f}"
            + (f", DDP buckets {b.ddp_buckets / GIB:.2f}" if b.ddp_buckets else "")
            + f" GiB) against {step.total / GIB:.2f} GiB for a training step"
        )
    return out


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
    pipe = _pipeline(workload, layout)
    overhead_model = CPU_OVERHEAD if hw.name == "cpu" else GPU_OVERHEAD
    ranks = [
        _rank_memory(workload, layout, pipe, rank, accum, accounting, overhead_model)
        for rank in range(layout.pp)
    ]
    peak = max(ranks, key=lambda r: r.total)  # the first of equal ranks
    build = max(ranks, key=lambda r: r.build_total)

    fpt = model_flops_per_token(cfg, workload.vocab_size, workload.seq_len)
    flops_step = fpt * tokens
    recompute = recompute_factor(layout.activation_checkpointing)
    compute_s = (
        flops_step / (layout.world * hw.peak(workload.precision) * mfu) * recompute / (1 - pipe.bubble)
    )
    comm, counts = _communication(workload, layout, pipe, peak, tokens, accum, accounting)
    dp_s = comm.dp / _link(hw, layout.tp * layout.dp)
    other_s = comm.tp / _link(hw, layout.tp) + comm.pp / _link(hw, layout.world)
    other_s += comm.ep / _link(hw, layout.tp * layout.ep)  # the all-to-alls wait: on the critical path
    exposed = other_s + max(0.0, dp_s - compute_s)
    step_s = compute_s + exposed
    tps = tokens / step_s
    chin = CHINCHILLA_TOKENS_PER_PARAM * n_params
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
        active_params=active_param_count(cfg, workload.vocab_size, workload.seq_len),
        device_params=sum(math.prod(tp_shape(t, layout.tp)) for t in peak.mine),
        pp_rank=peak.rank,
        states=peak.states,
        buffers=peak.buffers,
        activations=peak.activations,
        activation_parts=peak.parts,
        temporaries=peak.temps,
        overhead=peak.overhead,
        overhead_runtime=overhead_model.runtime_bytes,
        overhead_fraction=overhead_model.fragmentation,
        overhead_note=overhead_model.note,
        total=peak.total,
        peak_phase=peak.at_peak.name,
        gradients_at_peak=peak.at_peak.gradients,
        activations_at_peak=peak.at_peak.activations_row,
        temporaries_at_peak=sum(peak.at_peak.temporaries.values()),
        temporaries_alive=dict(peak.at_peak.temporaries),
        forward_buffers_alive=dict(peak.at_peak.forward_buffers),
        phase_totals=peak.phase_totals,
        flops_per_token=fpt,
        flops_per_step=flops_step,
        tokens_per_step=tokens,
        accum=accum,
        bubble=pipe.bubble,
        recompute=recompute,
        comm=comm,
        compute_s=compute_s,
        exposed_comm_s=exposed,
        step_s=step_s,
        tokens_per_s=tps,
        chinchilla_tokens=chin,
        chinchilla_days=chin / tps / 86400,
        build=build.build,
        build_overhead=build.build_overhead,
        build_total=build.build_total,
        build_pp_rank=build.rank,
        dp_collectives=counts,
        warnings=_warnings(workload, hw, build, peak),
        pp_rank_totals=[r.total for r in ranks],
        pp_rank_build_totals=[r.build_total for r in ranks],
    )


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
    loss: str = "fused",
    pipeline: bool = False,
    tokens: int = 0,
    nesterov: bool | None = None,
    weight_decay: bool = True,
    ep: int = 1,
) -> tuple[list[ParamTensor], StateBytes, Temporaries]:
    """The tensors of a pipeline rank owning the block ranges ``owned`` (the experts as ``ep`` splits
    them, ``plan/memory.py::expert_parallel``), their model states and the temporaries (the head's loss
    chunk on the rank owning the last block only); cached, since the layouts of a search that differ only
    in checkpointing or micro-batch share them."""
    tensors = expert_parallel(_param_tensors(model_json, vocab_size, seq_len), ep)
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
        loss,
        pipeline,
        tokens,
        nesterov,
        weight_decay,
        ModelConfig.model_validate_json(model_json).moe.top_k,
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
        p.defer_grad_sync,
        p.ep,
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
    o = cfg.optim
    optimizer = optimizer_key(o.name, o.sgd.momentum, o.soap.max_precond_dim)
    nesterov = {"sgd": o.sgd.nesterov, "muon": o.muon.nesterov}.get(o.name)
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
        nesterov=nesterov,
        weight_decay=o.group_weight_decay.get("matrix", o.weight_decay) > 0,
    )
