"""The one build path: a resolved config -> everything a run needs.

Every command that trains, probes or evaluates a model (``train``, ``lr-find``, ``mup-check``, ``eval``,
``generate``, the benchmarks) builds it here, so they agree with training by construction:

* :func:`validate` checks what can be checked before any work (accumulation, inputs, domains, device,
  the process layout of ``parallel.*`` against ``torchrun``'s world);
* :func:`build_model` builds the whole plain model in one process (``lmforge eval`` / ``generate``, a
  sample's gathered copy): on the meta device, materialised on the device, initialised from the seed (or
  left for a checkpoint to fill);
* :func:`build_run` adds the precision policy, the training module (``train/modules.py``: one per kind of
  objective) over the model and its loss with the transformations of ``lmforge.parallel.apply`` in their
  fixed order, the optimizer with its groups, the schedule, the clipper, the training loader (plain or
  mixture, one protocol) and the validation stream.

What differs between objectives (the checks, the network, the model's loss, the training module, the data,
its loader, the validation stream) is asked of ``train.objective``'s registered
:class:`~lmforge.train.modules.Objective` (``train/modules.py::objective_for``): this module names no
objective and imports nothing of ``posttrain/``.

The training model is sharded as it is built, in one process as in many: it is built on the meta device
(nothing allocated), every transformation (FP8 conversion, tensor parallelism, activation
checkpointing, compile, FSDP2) is applied there, and only then does each rank allocate and initialise its
own part of every parameter (``parallel/materialize.py``), with the values one process would give the
whole model from ``train.seed``. No rank ever holds the whole model unless its layout says so (one
process, DDP, ZeRO-1). A pipeline rank builds only its stages. The optimizer is built over the sharded
parameters. Rank 0 prepares the data (tokenizer, shards) while the others wait, then they read its cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.config import Config
from lmforge.data.loader import TokenStream, TrainLoader
from lmforge.data.prepare import PreparedData
from lmforge.errors import ConfigError
from lmforge.model.moe import register_balance_step
from lmforge.model.transformer import Transformer
from lmforge.optim.batch_schedule import BatchSchedule, check_batch_schedule, micro_tokens
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.optim.grad_transforms import GradTransforms
from lmforge.optim.schedules import Schedule
from lmforge.parallel.apply import ApplyContext, apply, can_compile, lora, materialize
from lmforge.parallel.comm_hooks import CommHook, comm_hook
from lmforge.parallel.data_parallel import GradientSync
from lmforge.parallel.layout import SINGLE, Layout, check_layout, init_layout, launch_env
from lmforge.parallel.materialize import Init
from lmforge.parallel.model_layout import check_compiled_layout, check_model_layout
from lmforge.parallel.pipeline import Pipeline, pipeline_settings, rank_model
from lmforge.parallel.reduce import StepReduce
from lmforge.parallel.tensor import check_tensor_parallel
from lmforge.plan.limit import check_run_memory
from lmforge.plan.micro_batch import auto_candidates
from lmforge.precision import PrecisionPolicy, check_precision, register_fp8_scale_precompute
from lmforge.probes.auto_batch import probe, resolve_micro_batch
from lmforge.train.modules import ModuleParts, PipelineModule, TrainModule, objective_for
from lmforge.train.runtime import configure_determinism, pick_device, seed_all

log = logging.getLogger(__name__)


def accumulation_steps(cfg: Config, world: int = 1) -> int:
    """Micro-batches per optimizer step: ``tokens_per_step / (micro_batch_size * seq_len * world)``."""
    per_micro = cfg.train.micro_batch_size * cfg.data.seq_len * world
    tokens = cfg.train.tokens_per_step or per_micro
    if tokens % per_micro:
        raise ConfigError(
            f"train.tokens_per_step: {tokens} is not a multiple of micro_batch_size * seq_len * world "
            f"= {per_micro}; use a multiple such as {max(1, round(tokens / per_micro)) * per_micro}"
        )
    return tokens // per_micro


def validate(cfg: Config) -> torch.device:
    """Everything checkable before work starts (user errors raise); returns the run's device. An
    unregistered ``train.objective`` is refused first; the objective's own checks run last."""
    objective = objective_for(cfg)
    device = pick_device(cfg.train.device)
    if cfg.parallel.offload and device.type != "cuda":
        raise ConfigError(
            "parallel.offload: offloading to host memory needs a CUDA device (FSDP2 computes on the "
            "accelerator; on a CPU the states already live in host memory); remove --parallel.offload"
        )
    if cfg.train.activation_offload and device.type != "cuda":
        raise ConfigError(
            "train.activation_offload: offloading activations to host memory needs a CUDA device (on a CPU "
            "they already live in host memory); remove --train.activation_offload"
        )
    check_precision(cfg.train, cfg.parallel, device, optimizer=cfg.optim.name)
    check_layout(cfg, launch_env()[2])
    check_model_layout(cfg)
    check_compiled_layout(cfg, device)
    check_qat(cfg)
    if cfg.train.micro_batch_size == "auto":
        auto_candidates(cfg)
    else:
        check_batch_schedule(cfg, accumulation_steps(cfg, cfg.parallel.dp_replicate * cfg.parallel.dp_shard))
    check_run_memory(cfg, device)  # the planned peak against parallel.max_memory_gb / the device's memory
    objective.check(cfg)  # lm: the inputs and domains; post-training: the records, its own refusals
    return device


def check_qat(cfg: Config) -> None:
    """``[qat]``: refused beside LoRA, FP8 and tensor parallelism (each owns the linear layers' forward or
    their weights' layout), and its group size must divide every target layer's input width."""
    if not cfg.qat.enabled:
        return
    for clash, why in (
        (cfg.lora.rank > 0, "lora.rank: LoRA's layers"),
        (cfg.train.precision == "fp8", "train.precision = fp8: torchao's float8 layers"),
        (cfg.train.precision == "fp64", "train.precision = fp64: torchao quantizes 32- and 16-bit floats"),
        (cfg.parallel.tp > 1, "parallel.tp: tensor-parallel shards (a group would span ranks)"),
    ):
        if clash:
            raise ConfigError(f"qat.enabled: fake quantization cannot wrap {why}; turn one of them off")
    from lmforge.model.qat import check_group_size

    with torch.device("meta"):  # widths only: the vocabulary does not matter (the head is not quantized)
        model = model_class(cfg)(cfg.model, 256, cfg.data.seq_len)
    check_group_size(model, cfg.qat.group_size)


def build_model(
    cfg: Config, vocab_size: int, device: torch.device, init: bool = True, adapters: bool = True
) -> Transformer:
    """The plain model of ``cfg``: built on the meta device (no memory, no init work), materialised on
    ``device``, then initialised from ``train.seed`` (``init=False``: left for a checkpoint to fill). A
    LoRA run's model has its adapters (``adapters=False``: the base alone, e.g. DPO's reference)."""
    with torch.device("meta"):
        model = model_class(cfg)(
            cfg.model, vocab_size, cfg.data.seq_len, cfg.train.attention, cfg.train.moe_kernel
        )
    if adapters and cfg.lora.rank:
        seed = cfg.train.seed if init else None
        ctx = ApplyContext(
            cfg.train, device, lora=cfg.lora, init=Init(device, tuple(model.init_plan()), seed)
        )
        seed_all(cfg.train.seed)
        return materialize(lora(model, model, ctx), model, ctx)
    model.materialize(device)
    if init:
        seed_all(cfg.train.seed)
        model.init_weights()
    return model


def model_class(cfg: Config) -> type[Transformer]:
    """The network of ``train.objective`` (its :meth:`~lmforge.train.modules.Objective.model_class`): the
    transformer, or a subclass with the objective's heads (a reward model, PPO's policy with its value
    head)."""
    return objective_for(cfg).model_class(cfg)


def training_module(
    cfg: Config,
    vocab_size: int,
    device: torch.device,
    layout: Layout = SINGLE,
    compute_dtype: torch.dtype = torch.float32,
    run_dir: Path | None = None,
    comm: CommHook | None = None,
) -> TrainModule:
    """The training module of ``cfg`` (no pipeline): the model built on the meta device, with its loss
    (the objective's :meth:`~lmforge.train.modules.Objective.function`: next-token; DPO: each sequence's
    log-probability) transformed in the fixed order, then this rank's shards materialised and initialised
    from ``train.seed`` as one process would (``parallel/apply.py``); the objective makes the module of
    them. ``comm``: DDP's gradient compression (:func:`~lmforge.parallel.comm_hooks.comm_hook`)."""
    t = cfg.train
    objective = objective_for(cfg)
    with torch.device("meta"):
        model = objective.model_class(cfg)(cfg.model, vocab_size, cfg.data.seq_len, t.attention, t.moe_kernel)
    seed_all(t.seed)  # Python's and numpy's generators as one process's build leaves them
    init = Init(device, tuple(model.init_plan()), t.seed)
    ctx = ApplyContext(t, device, layout, compute_dtype, init, cfg.lora, comm, cfg.qat)
    train_fn = apply(objective.function(cfg, model), model, ctx)
    # evaluation eager where training is compiled (too rare to pay for a second graph); FSDP2's root
    # must be called for its parameters to be gathered
    eval_fn = train_fn if layout.kind == "fsdp" else objective.function(cfg, model)
    experts = None
    if layout.ep > 1:
        from lmforge.parallel.expert import ExpertGradSync

        experts = ExpertGradSync(model, layout.ep_mesh, layout.dp)
    sync = GradientSync(train_fn, layout, cfg.parallel.defer_grad_sync, experts)

    def fresh(adapters: bool = False) -> Transformer:  # a whole plain model, unfilled (fp64: float64 too)
        plain = build_model(cfg, vocab_size, device, init=False, adapters=adapters)
        return plain.to(torch.float64) if compute_dtype == torch.float64 else plain

    return objective.module(ModuleParts(cfg, model, train_fn, eval_fn, sync, layout, device, run_dir, fresh))


@dataclass
class Run:
    """Everything a training run (or a probe of one) needs, built from one config."""

    cfg: Config
    device: torch.device
    precision: PrecisionPolicy
    data: Any  # the objective's prepared data (lm: PreparedData; post-training: posttrain/run.py's)
    model: Transformer  # the plain model (this rank's part): parameters, state_dict, sampling
    module: TrainModule  # what a training step drives (train/modules.py)
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    clipper: Clipper
    loader: TrainLoader
    val: TokenStream | None  # the validation split (post-training: None, its held-out records are in data)
    accum: int  # micro-batches per optimizer step and data-parallel rank
    layout: Layout = SINGLE
    reduce: StepReduce = field(default_factory=StepReduce)
    transforms: GradTransforms = field(default_factory=lambda: GradTransforms({}))  # noise, centralization
    comm: CommHook | None = None  # DDP's gradient compression and its byte count (DDP and ZeRO-1 only)
    batch_schedule: BatchSchedule | None = None  # train.batch_schedule (None: ``accum`` every step)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step of the full batch (``accum`` micro-batches) over all data-parallel
        ranks: positions of its rows (DPO: two rows a pair, counted at ``data.seq_len`` although a batch is
        padded only to its longest pair)."""
        return self.tokens_of(self.accum)

    def tokens_of(self, accum: int) -> int:
        """Tokens of a step of ``accum`` micro-batches per data-parallel rank (a batch schedule's step)."""
        rows = self.cfg.train.micro_batch_size * objective_for(self.cfg).rows
        return accum * rows * self.cfg.data.seq_len * self.layout.dp


def local_processes() -> int:
    """Processes of this run on this host (``torchrun``'s ``LOCAL_WORLD_SIZE``; 1 for a plain process)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def build_run(cfg: Config, data: PreparedData | None = None, run_dir: Path | None = None) -> Run:
    """Build every part of a run of ``cfg`` (``data``: already prepared data, else prepared here).
    ``train.micro_batch_size = "auto"`` is resolved first (``probes/auto_batch.py``); the run's ``cfg``
    holds the number chosen. The data, its loader and the validation stream are the objective's (a
    post-training one reads its records instead of ``data.sources`` and finds its reference in
    ``run_dir``)."""
    device = validate(cfg)
    layout = init_layout(cfg, device.type)
    if device.type == "cuda" and layout.distributed:
        device = torch.device("cuda", torch.cuda.current_device())
    auto = cfg.train.micro_batch_size == "auto"
    cfg, smaller, optimizer_bytes = resolve_micro_batch(cfg, device, local_processes())
    configure_determinism(cfg.train.deterministic)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device, cfg.train.loss_scale, layout.distributed)
    objective = objective_for(cfg)
    if data is None:
        data = objective.prepare(cfg, layout, run_dir)
    if layout.degrees["tp"] > 1:  # the tokenizer's own vocabulary, now that it is known
        check_tensor_parallel(cfg.model, data.tokenizer.vocab_size, cfg.data.seq_len, layout.degrees["tp"])
    vocab = data.tokenizer.vocab_size
    with torch.device("meta"):
        n_params = Transformer(cfg.model, vocab, cfg.data.seq_len).num_params(False)
    comm = None
    if layout.kind in ("ddp", "zero1"):
        comm = comm_hook(cfg.parallel, layout.group("dp"), cfg.train.seed, layout.dp)
    if layout.degrees["pp"] > 1:
        module = build_pipeline(cfg, vocab, device, layout, precision)
    else:
        module = training_module(cfg, vocab, device, layout, precision.compute_dtype, run_dir, comm)
    model = module.model
    if auto and device.type == "cuda" and not layout.distributed:
        cfg = probe(module.train_fn, cfg, smaller, vocab, precision.autocast, optimizer_bytes)
    accum = accumulation_steps(cfg, layout.dp)
    batch_schedule = BatchSchedule(
        cfg.train.batch_schedule, check_batch_schedule(cfg, accum), accum, micro_tokens(cfg)
    )
    compile = can_compile(cfg.train.compile, device)
    if layout.kind == "zero1":
        from lmforge.optim.build import build_zero_optimizer

        optimizer = build_zero_optimizer(model, cfg.optim, device, compile, layout.group("dp_shard"))
    else:
        optimizer = build_optimizer(model, cfg.optim, device, compile=compile)
    register_fp8_scale_precompute(optimizer, model)  # FSDP2's float8 all-gather: scales after each step
    # MoE: each step's expert load summed over data-parallel ranks, the balancing bias updated
    register_balance_step(optimizer, model, layout.group("dp") if layout.dp > 1 else None)
    log.info(
        "model: %s, %.2fM parameters; %d micro-batches of %d x %d per step and data-parallel rank; %s",
        cfg.model.arch,
        n_params / 1e6,
        accum,
        cfg.train.micro_batch_size,
        cfg.data.seq_len,
        layout.describe(),
    )
    bs = cfg.train.batch_schedule
    if bs.name != "constant":
        log.info(
            "batch schedule: %s from %d to %d micro-batches per step and rank (%s), learning rate x (B / %d)^%s",
            bs.name,
            batch_schedule.start,
            accum,
            f"over {bs.ramp_tokens:,} tokens"
            if bs.name == "ramp"
            else f"{bs.noise_multiple:g} x B_simple every {bs.interval} steps",
            accum * micro_tokens(cfg),
            {"none": "0", "linear": "1", "sqrt": "1/2"}[bs.lr_rule],
        )
    clipper = Clipper.from_config(cfg.train)
    if layout.degrees["pp"] > 1:  # each stage holds other parameters: norms add up over the pipeline
        clipper.across = layout.group("pp")
        copies = model.tied_copies()  # a tied matrix's copy on the last stage: counted once, on stage 0
        clipper.copies = frozenset(id(p) for n, p in model.named_parameters() if n in copies)
    return Run(
        cfg=cfg,
        device=device,
        precision=precision,
        data=data,
        model=model,
        module=module,
        optimizer=optimizer,
        schedule=Schedule(cfg.schedule, cfg.train.steps),
        clipper=clipper,
        loader=objective.loader(cfg, data, layout.dp_rank, layout.dp, run_dir, accum),
        val=objective.validation(data),
        accum=accum,
        layout=layout,
        reduce=StepReduce(layout),
        transforms=grad_transforms(cfg, model),
        comm=comm,
        batch_schedule=batch_schedule,
    )


def grad_transforms(cfg: Config, model: nn.Module) -> GradTransforms:
    """``optim.grad_noise`` and ``optim.grad_centralization`` over ``model``'s parameters, the noise seeded
    by ``train.seed``."""
    o = cfg.optim
    return GradTransforms.for_model(
        model, o.grad_centralization, o.grad_noise.eta, o.grad_noise.gamma, cfg.train.seed
    )


def build_pipeline(
    cfg: Config, vocab_size: int, device: torch.device, layout: Layout, precision: PrecisionPolicy
) -> PipelineModule:
    """This rank's pipeline stages (cut on the meta device, transformed in the fixed order, then
    materialised and initialised as in the whole model) and the module that runs their schedule."""
    p = cfg.parallel
    microbatches, v = pipeline_settings(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank)

    def build() -> Transformer:
        t = cfg.train
        return Transformer(
            cfg.model, vocab_size, cfg.data.seq_len, attention=t.attention, moe_kernel=t.moe_kernel
        )

    train = cfg.train
    if p.pp_schedule in ("zero_bubble", "zbv") and train.compile:
        log.warning("train.compile: the zero-bubble schedules run eager stages (torch refuses compiled ones)")
        train = train.model_copy(update={"compile": False})
    ctx = ApplyContext(train, device, layout, precision.compute_dtype, qat=cfg.qat)
    seed_all(cfg.train.seed)
    pipeline = Pipeline(
        build,
        layout.group("pp"),
        p.pp_schedule,
        microbatches,
        v,
        device,
        seed=cfg.train.seed,
        loss_chunk=cfg.train.loss_chunk,
        transform=lambda stage, init: apply(stage, stage, dataclasses.replace(ctx, init=init)),
    )
    log.info(
        "pipeline: %s, %d stages of layers %s on this rank, %d microbatches; ideal bubble %.3f",
        p.pp_schedule,
        len(pipeline.models),
        ", ".join(f"{min(m.blocks, key=int)}-{max(m.blocks, key=int)}" for m in pipeline.models),
        microbatches,
        pipeline.expected_bubble,
    )
    model = rank_model(pipeline.models)
    experts = None
    if layout.ep > 1:  # each stage's experts: summed over the ranks of the stage holding the same ones
        from lmforge.parallel.expert import ExpertGradSync

        experts = ExpertGradSync(model, layout.ep_mesh, layout.dp)
    return PipelineModule(pipeline, model, experts)
