"""Pipeline parallelism: each rank of the pipeline group owns a contiguous slice of the blocks.

Why a pipeline: a model whose weights, gradients and optimizer state do not fit one device is cut by depth
into ``S`` stages (``S = pp * stages_per_rank``); stage ``s`` keeps the blocks
:func:`stage_layers` gives it (the embedding with block 0, the final norm, output head and loss with the
last block; ``model.transformer.keep_stage``), so its parameter names, state-dict keys and optimizer
groups are those of the whole model. A batch is split into ``m`` microbatches that flow through the
stages; ``torch.distributed.pipelining`` runs the schedule (which stage does which forward or backward
when) and the point-to-point sends of activations and their gradients.

Schedules (:data:`SCHEDULES`), ``p`` pipeline ranks, ``m`` microbatches, ``v`` stages per rank:

* ``gpipe``: all forwards, then all backwards; activations of all ``m`` microbatches are alive at once.
* ``1f1b``: one forward, one backward in the steady state; at most ``p`` microbatches in flight.
  Same bubble as GPipe, less memory.
* ``interleaved_1f1b``: ``v >= 2`` stages per rank placed round-robin (rank ``r`` owns stages
  ``r, r + p, ...``), so each pipeline hop is ``1 / v`` of a rank's work and the bubble shrinks ``v``-fold.
* ``zero_bubble`` (ZB1P, loop placement) and ``zbv`` (ZB-V, rank ``r`` owns stages ``r`` and
  ``2p - 1 - r``): the backward is split into the input gradient (on the critical path) and the weight
  gradient, which is deferred into what would otherwise be bubble.

Bubble (:func:`bubble_fraction`): the ideal fraction of a step a rank sits idle; :class:`Pipeline` also
measures it (``1 - busy / wall`` with busy = the time spent in its stages' forward, backward and loss;
on CUDA each timed region is bracketed by a device synchronisation, which costs some overlap). The first
step also runs the schedule's shape inference, so its figure is high. Measured on 2 CPU cores, 2 gloo
ranks of one thread (Llama 8 x 256, vocab 512, batch 16 x 128, mean of steps 2-5, both ranks):
gpipe m=4 0.19 (formula 0.20), 1f1b m=4 0.17-0.21 (0.20), 1f1b m=8 0.12-0.17 (0.11), interleaved_1f1b
m=8 v=2 0.09-0.11 (0.06), zero_bubble 0.09-0.13 (0.06), zbv 0.05 (0.06); with smaller microbatches
the fixed cost of each send and each Python-side action grows relative to the compute.

Evaluation (:meth:`Pipeline.eval_loss`) runs its own forward-only pass rather than ``schedule.eval``
(reasons in its docstring).

Document masks: ``Transformer.forward(x, doc_ids)`` needs ``doc_ids`` on every stage, not only the first.
``torch.distributed.pipelining`` gives positional arguments to the first stage only (later stages receive
the previous stage's output) but hands each rank's keyword arguments of ``schedule.step(..., **kwargs)``,
split into microbatches like the inputs, to every stage it runs (``PipelineStage.forward_one_chunk``). So
every rank passes ``doc_ids=`` to ``step``: nothing about the mask crosses the wire.

Initialisation is exact: a stage gets bit for bit the parameters the single-process model gets from the
same seed on the same device. Each stage is cut from the model on the meta device (:func:`stage_model`),
goes through the model transformations there, and is then materialised by the whole model's
initialisation plan (:func:`whole_init`, ``parallel/materialize.py``): every parameter of the whole model
is drawn in module order, so the random stream advances exactly as in one process, and the stage keeps
its own (its shards, under TP or FSDP2). Peak memory: the stage's part plus the largest parameter.

Tied embeddings (``model.tie_embeddings``, the default): stage 0 uses the matrix as the embedding and the
last stage as the output head. Where one rank runs both (``zbv``) they share one parameter; elsewhere
each end holds a copy, both initialised with the tied matrix's single-process values (the whole plan
names it under both names), and :meth:`Pipeline.reduce_tied_grads` sums the copies' gradients over the
two ranks once per step, so they take the same optimizer step and stay equal bit for bit. Norms count the
matrix once and checkpoints hold the one-process keys (``parallel/tied_embedding.py``).

Gradients: the loss of each microbatch is ``sum of token CE * loss_scale``; with ``loss_scale = 1 /
(target tokens of the whole optimizer step)`` the accumulated gradients are those of
``train/step.py`` (the schedule's own division by ``m`` is turned off: ``scale_grads=False``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from lmforge.errors import ConfigError
from lmforge.model.loss import head_loss
from lmforge.model.moe import carry_aux_loss, moe_layers, take_aux_loss
from lmforge.model.transformer import Transformer, keep_stage
from lmforge.parallel.materialize import Init, materialize
from lmforge.parallel.tied_embedding import TiedEmbedding, tie_stages

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv",)  # rank r owns stages r and 2p - 1 - r
# the backward split in two (autograd.grad): "I", the stage input's gradient, and later "W", the weights'
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous block ranges of ``n_stages`` stages, as even as possible: each stage gets
    ``n_layers // n_stages`` blocks and the first ``n_layers % n_stages`` stages one more (the last stage
    also carries the output head and the loss, so extra blocks go to the front)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} non-empty stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Ideal idle fraction of a pipeline step: ``(p - 1) / (v * m + p - 1)``.

    ``p`` ranks, ``m`` microbatches, ``v`` stages per rank (1: GPipe and 1F1B, whose bubble is
    ``(p - 1) / (m + p - 1)``; ``v``: interleaved 1F1B, where fill and drain take ``p - 1`` hops of
    ``1 / v`` of a rank's work each). It assumes equal stage times and free communication. Zero-bubble
    schedules move weight-gradient work into this idle time, so for them it is an upper bound.
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"bubble_fraction needs p, m, v >= 1, got {p}, {m}, {v}")
    return (p - 1) / (v * m + p - 1)


def stage_ids(rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Stage indices owned by pipeline rank ``rank``, ascending: round-robin ``rank, rank + pp, ...``, or
    the V placement ``rank, 2 pp - 1 - rank`` of ``zbv``."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(stages_per_rank)]


def stage_owners(pp: int, stages_per_rank: int, schedule: str) -> dict[int, int]:
    """Pipeline rank of every stage index (the inverse of :func:`stage_ids`)."""
    return {s: r for r in range(pp) for s in stage_ids(r, pp, stages_per_rank, schedule)}


def schedule_order(pp: int, schedule: str, microbatches: int, stages_per_rank: int) -> dict[int, list[tuple]]:
    """Each pipeline rank's compute actions, ``(stage index, kind, micro-batch)`` in the order torch's
    multi-stage schedule runs them; ``kind``: ``F`` forward, ``B`` a whole backward, ``I`` the backward to
    the stage's input only, ``W`` the weights' backward of an earlier ``I``. Read from the schedule
    class's own table (its ``pipeline_order``, ``_calculate_single_rank_operations`` in torch 2.13),
    computed here without stages or a process group, for the planner (``plan/estimate.py``). ValueError
    for a one-stage schedule (``gpipe``, ``1f1b``) or a torch whose schedules no longer compute it so."""
    if schedule in SINGLE_STAGE or schedule not in SCHEDULES:
        raise ValueError(f"schedule_order: {schedule!r} is not a multi-stage schedule")
    cls = SCHEDULES[schedule]
    table = cls.__new__(cls)  # the table's inputs only: no stages, no process group
    rounds = max(1, microbatches // pp)
    table.pp_group_size, table._n_microbatches, table.n_local_stages = pp, microbatches, stages_per_rank
    table.num_stages = table._num_stages = pp * stages_per_rank
    table.number_of_rounds, table.microbatches_per_round = rounds, microbatches // rounds
    out: dict[int, list[tuple]] = {}
    try:
        for rank in range(pp):
            table.rank = rank
            ops = table._calculate_single_rank_operations(rank)
            out[rank] = [(a.stage_index, str(a.computation_type.value), a.microbatch_index) for a in ops if a]
    except AttributeError as exc:  # torch's schedules changed how they compute their table
        raise ValueError(
            f"schedule_order: torch's {cls.__name__} table is not computable here: {exc}"
        ) from exc
    return out


def check_pipeline(
    n_layers: int,
    pp: int,
    schedule: str,
    microbatches: int,
    micro_batch_size: int | None,
    stages_per_rank: int = 1,
) -> None:
    """Refuse pipeline settings that cannot run, each with one line naming the key and the fix.

    ``micro_batch_size``: rows of the batch one :meth:`Pipeline.step` splits into ``microbatches``
    (None: not checked). The microbatch rules are those the torch schedules enforce (torch 2.13).
    """
    if pp < 1:
        raise ConfigError(f"parallel.pp: must be >= 1, got {pp}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if microbatches < 1:
        raise ConfigError(f"parallel.pp_microbatches: must be >= 1, got {microbatches}")
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        raise ConfigError(
            f"parallel.pp_stages_per_rank: {schedule} runs one stage per rank, got {stages_per_rank}; "
            "set it to 1 or use --parallel.pp_schedule=interleaved_1f1b"
        )
    if schedule not in SINGLE_STAGE and stages_per_rank < 2:
        raise ConfigError(
            f"parallel.pp_stages_per_rank: {schedule} needs 2 or more stages per rank, got {stages_per_rank}"
        )
    if schedule in V_SHAPED and stages_per_rank != 2:
        raise ConfigError(f"parallel.pp_stages_per_rank: {schedule} needs exactly 2, got {stages_per_rank}")
    n_stages = pp * stages_per_rank
    if n_layers < n_stages:
        raise ConfigError(
            f"parallel.pp: {pp} ranks x {stages_per_rank} stages per rank = {n_stages} stages need at "
            f"least that many layers (model.n_layers = {n_layers}); lower parallel.pp or "
            "parallel.pp_stages_per_rank"
        )
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"parallel.pp_microbatches: 1f1b needs at least parallel.pp = {pp} microbatches, got "
            f"{microbatches}"
        )
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"parallel.pp_microbatches: {schedule} runs max(1, microbatches // pp) = {rounds} rounds "
                f"and needs microbatches divisible by them, got {microbatches}; use a multiple of "
                f"parallel.pp = {pp}"
            )
    if micro_batch_size is not None and micro_batch_size % microbatches:
        raise ConfigError(
            f"parallel.pp_microbatches: {microbatches} microbatches must divide train.micro_batch_size = "
            f"{micro_batch_size} (equal microbatch shapes); use a divisor of it"
        )


def stage_model(build: Callable[[], Transformer], layers: range) -> Transformer:
    """The stage of the model ``build()`` that owns blocks ``layers``, on the meta device (nothing
    allocated; the model transformations and :func:`~lmforge.parallel.materialize.materialize` follow)."""
    with torch.device("meta"):
        return keep_stage(build(), layers)


def whole_init(build: Callable[[], Transformer], device: torch.device | str, seed: int | None) -> Init:
    """How a stage of ``build()`` is initialised: the *whole* model's plan walked from ``seed``, so each
    stage gets bit for bit the values one process gives those parameters (``parallel/materialize.py``)."""
    with torch.device("meta"):
        plan = tuple(build().init_plan())
    return Init(torch.device(device), plan, seed)


def build_stage(
    build: Callable[[], Transformer], layers: range, device: torch.device | str, seed: int | None
) -> Transformer:
    """The stage of ``build()`` owning blocks ``layers``, materialised on ``device`` and initialised exactly
    as the whole model is from ``seed`` (None: storage left uninitialised for a checkpoint). Peak memory:
    the stage plus the largest parameter of the whole model."""
    stage = stage_model(build, layers)
    materialize(stage, stage, whole_init(build, device, seed))
    return stage


def _materialized(stage: Transformer, init: Init) -> Transformer:
    materialize(stage, stage, init)
    return stage


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds the time of its forward and backward work to ``clock[0]``, and knows
    the weight of each microbatch's MoE balance losses (``aux_weights[i]`` for microbatch ``i``, set by
    :meth:`Pipeline.step`; ``aux_weight``: the one of the forward running now)."""

    def __init__(self, *args, clock: list[float], aux_weights: list[float], **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.aux_weights, self.aux_weight = clock, aux_weights, 0.0
        self.in_chunk = False  # a forward of the schedule's microbatches (not its shape inference)

    def _timed(self, fn: Callable, *args, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync(self.device)
            self.clock[0] += time.perf_counter() - start

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        if self.aux_weights:
            self.aux_weight = self.aux_weights[fwd_chunk_id]
        self.in_chunk = True
        try:
            return self._timed(super().forward_one_chunk, fwd_chunk_id, *args, **kwargs)
        finally:
            self.in_chunk = False

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def _moe_hooks(stage: _TimedStage, model: nn.Module, run: nn.Module) -> None:
    """Hooks on the module a stage runs, for the stage's MoE layers (``model/moe.py``): after a forward of
    a microbatch, the layers' balance losses (:func:`~lmforge.model.moe.take_aux_loss`), times the
    microbatch's weight, ride on its output (:func:`~lmforge.model.moe.carry_aux_loss`), so that the
    schedule's backward from that output trains them. The forward the schedule runs on its first step to
    infer the stages' shapes (outside any microbatch, on the first one's inputs or on uninitialised
    tensors of the right shape) counts nothing: the layers' counters are put back as they were."""
    layers = [layer for _, layer in moe_layers(model)]
    saved: list[torch.Tensor] = []

    def before(module: nn.Module, args: tuple) -> None:
        if not stage.in_chunk:
            saved[:] = [b.clone() for layer in layers for b in (layer.load, layer.sums)]

    def after(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        aux = take_aux_loss(model)
        if not stage.in_chunk:
            with torch.no_grad():
                for buf, old in zip(
                    (b for layer in layers for b in (layer.load, layer.sums)), saved, strict=True
                ):
                    buf.copy_(old)
            return None
        return output if aux is None else carry_aux_loss(output, aux * stage.aux_weight)

    run.register_forward_pre_hook(before)
    run.register_forward_hook(after)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; the CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pipeline:
    """This rank's stages of a pipeline-parallel model and the schedule that runs them.

    ``build()`` returns a fresh plain :class:`Transformer` (it runs under the meta device); every rank
    keeps its stages (:func:`stage_ids`, :func:`stage_layers`), cut from the model on the meta device, and
    initialises them exactly as the whole model is from ``seed`` (None: leave them for a checkpoint).
    ``group``: the pipeline process group or a 1-D device mesh (None: the default group). ``models``: the
    stage modules, ascending by stage index, for the optimizer and state dicts (names as in the whole
    model). ``transform(stage, init)``: applied to each meta stage before the schedule sees it (the model
    transformations of ``parallel/apply.py``: tensor parallelism, compilation, FSDP2, and last the
    materialisation by ``init``); it may change the stage in place or wrap it. Without one, each stage is
    materialised plainly. ``tied``: this rank's part of a tied embedding (None untied;
    :meth:`reduce_tied_grads`).
    """

    def __init__(
        self,
        build: Callable[[], Transformer],
        group: dist.ProcessGroup | DeviceMesh | None,
        schedule: str,
        microbatches: int,
        stages_per_rank: int = 1,
        device: torch.device | str = "cpu",
        seed: int | None = 0,
        loss_chunk: int = 1024,
        transform: Callable[[Transformer, Init], nn.Module] | None = None,
    ):
        if isinstance(group, DeviceMesh):
            group = group.get_group()
        group = group or dist.group.WORLD
        self.group = group
        self.pp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.schedule_name, self.microbatches, self.stages_per_rank = schedule, microbatches, stages_per_rank
        self.device = torch.device(device)
        with torch.device("meta"):
            cfg = build().cfg
        check_pipeline(cfg.n_layers, self.pp, schedule, microbatches, None, stages_per_rank)
        n_stages = self.pp * stages_per_rank
        layers = stage_layers(cfg.n_layers, n_stages)
        self.stage_ids = stage_ids(self.rank, self.pp, stages_per_rank, schedule)
        self.models = [stage_model(build, layers[s]) for s in self.stage_ids]
        init = whole_init(build, self.device, seed)
        transform = transform or _materialized
        runs = [transform(m, init) for m in self.models]
        self.tied: TiedEmbedding | None = None
        if cfg.tie_embeddings:
            owner = stage_owners(self.pp, stages_per_rank, schedule)
            local = dict(zip(self.stage_ids, self.models, strict=True))
            first, last = local.get(0), local.get(n_stages - 1)
            self.tied = tie_stages(first, last, group, owner[0], owner[n_stages - 1])
        self._clock = [0.0]
        self._aux_weights: list[float] = []
        self.stages = [
            _TimedStage(
                module,
                s,
                n_stages,
                self.device,
                group=group,
                clock=self._clock,
                aux_weights=self._aux_weights,
            )
            for s, module in zip(self.stage_ids, runs, strict=True)
        ]
        self.has_moe = any(True for m in self.models for _ in moe_layers(m))  # on this rank
        self.has_moe_anywhere = cfg.moe.experts > 0  # on some stage of the pipeline
        for stage, model, run in zip(self.stages, self.models, runs, strict=True):
            if any(True for _ in moe_layers(model)):
                _moe_hooks(stage, model, run)
        self.has_first = 0 in self.stage_ids
        self.has_last = n_stages - 1 in self.stage_ids
        self._last = self.models[self.stage_ids.index(n_stages - 1)] if self.has_last else None
        self._chunk = loss_chunk
        self._scale = 1.0
        cls = SCHEDULES[schedule]
        first = self.stages[0] if schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(first, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False)
        self.last_busy = self.last_wall = self.last_bubble = float("nan")

    @property
    def expected_bubble(self) -> float:
        """:func:`bubble_fraction` of this pipeline (an upper bound for the zero-bubble schedules)."""
        return bubble_fraction(self.pp, self.microbatches, self.stages_per_rank)

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of the tied embedding's copies (``model.tie_embeddings``: stage 0's embedding
        and the last stage's head, ``parallel/tied_embedding.py``) over the embedding group. Call it once
        per optimizer step, after the backward of its last :meth:`step` and before the gradients are read
        (unscaled, measured, clipped): ``train/modules.py::PipelineModule.finish_backward``. Nothing to do
        untied, on the ranks of middle stages, and where one parameter serves both stages."""
        if self.tied is not None:
            self.tied.reduce_grads()

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of one microbatch on the last stage: ``sum of token CE * loss_scale``."""
        sync(self.device)
        start = time.perf_counter()
        loss = head_loss(self._last, hidden, targets, self._chunk) * self._scale
        sync(self.device)
        self._clock[0] += time.perf_counter() - start
        return loss

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> torch.Tensor | None:
        """Forward and backward of this rank's whole batch through the schedule, in ``microbatches``
        equal parts; every rank passes the same batch (the first stage reads ``inputs``, the last
        ``targets``, all ``doc_ids``). Gradients accumulate into the stage parameters. Returns, on the
        rank of the last stage, the sum over microbatches of ``sum of token CE * loss_scale`` (detached;
        None elsewhere). Sets ``last_busy``, ``last_wall`` and ``last_bubble`` of this rank."""
        if inputs.shape[0] % self.microbatches:
            raise ValueError(f"batch of {inputs.shape[0]} rows does not split into {self.microbatches}")
        self._scale, self._clock[0] = loss_scale, 0.0
        if self.has_moe:  # each microbatch's balance losses weigh as its targets do in the loss
            counts = [int((t != -100).sum()) for t in targets.tensor_split(self.microbatches)]
            self._aux_weights[:] = [n * loss_scale for n in counts]
        args = (inputs.to(self.device),) if self.has_first else ()
        kwargs = {} if doc_ids is None else {"doc_ids": doc_ids.to(self.device)}
        target = targets.to(self.device) if self.has_last else None
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        sync(self.device)
        start = time.perf_counter()
        self.schedule.step(*args, target=target, losses=losses, **kwargs)
        sync(self.device)
        self.last_wall = time.perf_counter() - start
        self.last_busy = self._clock[0]
        self.last_bubble = 1.0 - self.last_busy / self.last_wall
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    @torch.no_grad()
    def eval_loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forward only: ``(sum of token CE, number of targets)`` of the batch on the rank of the last
        stage, None elsewhere; every rank passes the same batch (any number of rows).

        Not ``schedule.eval``: in torch 2.13 it fails for ``zbv`` (the V schedule hands input gradients
        between its two local stages even without a backward), and every switch between it and
        ``schedule.step`` makes the schedule infer its stage shapes again, so an evaluation batch must
        have the training batch's shape. Here each rank runs its stages in ascending order, microbatch
        by microbatch, receiving activations from the previous stage's rank and sending them on with
        non-blocking sends; a stage waits only on the stage before it, so no rank waits on work that
        waits on it.
        """
        n_stages = self.pp * self.stages_per_rank
        owner = stage_owners(self.pp, self.stages_per_rank, self.schedule_name)
        chunks = min(self.microbatches, inputs.shape[0])
        parts = [
            t.tensor_split(chunks) if t is not None else [None] * chunks for t in (inputs, targets, doc_ids)
        ]
        local: dict[int, torch.Tensor] = {}
        sends: list = []
        wide = next(self.models[0].parameters()).dtype == torch.float64  # train.precision = "fp64"
        total = torch.zeros((), dtype=torch.float64 if wide else torch.float32, device=self.device)
        for s, model in zip(self.stage_ids, self.models, strict=True):
            dtype = next(model.parameters()).dtype
            for i, (x, y, d) in enumerate(zip(*parts, strict=True)):
                d = d.to(self.device) if d is not None else None
                if s == 0:
                    h_in = x.to(self.device)
                elif owner[s - 1] == self.rank:
                    h_in = local.pop(i)
                else:
                    h_in = torch.empty((*x.shape, model.cfg.d_model), dtype=dtype, device=self.device)
                    dist.recv(h_in, src=dist.get_global_rank(self.group, owner[s - 1]), group=self.group)
                h = model(h_in, d)
                if s == n_stages - 1:
                    total += head_loss(model, h, y.to(self.device), self._chunk)
                elif owner[s + 1] == self.rank:
                    local[i] = h
                else:
                    out = h.to(dtype).contiguous()  # kept alive (in sends) until its send completes
                    dst = dist.get_global_rank(self.group, owner[s + 1])
                    sends.append((dist.isend(out, dst=dst, group=self.group), out))
        for work, _ in sends:
            work.wait()
        return (total, (targets != -100).sum()) if self.has_last else None


def pipeline_settings(pp: int, schedule: str, microbatches: int, stages_per_rank: int) -> tuple[int, int]:
    """``(microbatches, stages_per_rank)`` with the defaults filled in: 2 stages per rank for the
    interleaved and zero-bubble schedules, else 1; ``pp x stages_per_rank`` microbatches."""
    v = stages_per_rank or (1 if schedule in SINGLE_STAGE else 2)
    return microbatches or pp * v, v


def rank_model(models: list[Transformer]) -> Transformer:
    """One module holding every parameter of this rank's stages under the whole model's names (the
    embedding of stage 0, the blocks of each stage, the final norm and head of the last): what the
    optimizer, the parameter groups and the checkpoints see. It shares the stage modules' parameters
    and is never called; the stages run through the schedule. A tied head that is a copy of the
    embedding (not its parameter) stays ``lm_head.weight``, listed by ``tied_copies()``."""
    if len(models) == 1:
        return models[0]
    first, last = models[0], models[-1]
    with torch.device("meta"):
        owner = Transformer(first.cfg, first.vocab_size, first.max_seq_len, attention=first.attention)
    owner.embed, owner.pos_embed = first.embed, first.pos_embed
    owner.norm, owner.lm_head = last.norm, last.lm_head
    owner.blocks = type(first.blocks)({k: b for m in models for k, b in m.blocks.items()})
    return owner
