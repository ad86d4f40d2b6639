"""The model transformations of a run, applied from outside the model in one fixed order.

    lora -> qat -> convert -> tensor parallel -> expert parallel -> activation checkpointing -> compile
         -> data-parallel sharding -> materialize

Each stage is a function ``(module, model, ctx) -> module`` (``module``: what the training step will call,
transformed so far; ``model``: the plain network inside it) and :data:`STAGES` lists them in that order;
this is the only place the order is written. The model arrives on the meta device (nothing allocated):
every stage but the last only rearranges it, and the last gives this rank's shards their storage and
values. The order is forced by what each stage needs to see:

0. ``lora`` (``[lora]``, ``lmforge/model/lora.py``) replaces the target linear layers by LoRA layers
   (adapters ``lora_A`` / ``lora_B`` added, parameter names of the base unchanged) and freezes every
   other parameter but the heads the objective trains in full. Which layers each of LoRA, QAT and FP8
   may replace, and how a layer is replaced, is written once, in ``lmforge/model/wrap.py``. It comes first because it changes what the later stages see: which modules exist
   (compile traces and FSDP2 wraps the adapted layers), which parameters there are (FSDP2 shards the
   adapters with their block; the materialize stage initialises them) and which train (DDP and FSDP2
   register gradient hooks and reduce only for parameters that require grad, so freezing must precede
   them). QLoRA's quantisation of the frozen weights needs their values, so it happens in ``materialize``.
0b. ``qat`` (``[qat]``, ``lmforge/model/qat.py``) replaces the linear layers by ones that fake-quantize
   their weights and inputs (same parameters): compile must trace the quantize-dequantize and FSDP2
   gathers the whole weight before a layer's forward, so the groups of a row are all there. It refuses
   to meet LoRA's layers, FP8's conversion and tensor parallelism (``train/build.py::validate``).
1. ``convert`` swaps module types (FP8 linear layers, lmforge/precision): every later stage must see the
   final modules, and tensor parallelism must shard the converted weights.
2. ``tensor_parallel`` (``parallelize_module``) shards the weights of each block across the TP mesh;
   ``expert_parallel`` shards the MoE layers' experts across the ``ep`` ranks (DTensors, which the data-
   parallel stage then leaves out of DDP and FSDP2).
3. ``activation_checkpointing`` (``train.activation_checkpointing``: ``none``, ``full``, ``every:K``,
   ``selective``) makes whole blocks recompute in backward, which must already be sharded. It sets each
   block's ``runner`` attribute (no wrapper module: parameter names stay); see
   :func:`activation_checkpointing` for the policies.
4. ``compile`` traces the blocks as they will run: converted, sharded and checkpointed.
5. ``data_parallel`` (``fully_shard`` / DDP) wraps the compiled modules and owns the parameters'
   storage from then on. FSDP2 shards the meta parameters; DDP broadcasts real ones at construction, so
   its replicas are materialised first (a replica is the whole model anyway).
6. ``materialize`` (``lmforge/parallel/materialize.py``): this rank's part of every parameter is
   allocated and initialised exactly as one process initialises the whole model from ``train.seed``,
   one whole parameter at a time: the peak is the rank's shards plus the largest parameter, never the
   whole model. A module that is already real (a test's, a probe's) passes through unchanged.

``convert`` swaps the linear layers for torchao's float8 ones with ``train.precision = "fp8"`` (else
it returns the module unchanged). Activation offloading (``train.activation_offload``, CUDA) is not a
stage: its saved-tensor hooks wrap the whole training step (:func:`activation_offload`). Pipeline
parallelism cuts the model into stages (``lmforge/parallel/pipeline.py``)
before any of them; the stages then run on each stage's objective.

Compilation: a single process compiles the whole training objective
(:class:`~lmforge.model.loss.NextTokenLoss`); it never replaces a method of the model. The fused output
head + loss inside it is not traced (``model/fused_loss.py`` says why: the graph breaks around it) and
its element-wise kernels are compiled on their own (``OutputHead.compile_loss``), in every layout.
Measured on 2 CPU cores (default Llama 4 x 256, vocab 4096, batch 8 x 256, BF16, with the former chunked
loss): eager 3,540 tokens/s, every block compiled separately 3,350, the whole objective compiled 4,070.
Several processes compile each block in place instead (``Module.compile``), so that the hooks of
FSDP2, DDP and tensor parallelism stay at block boundaries, outside the compiled graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lmforge.config import LoraConfig, QATConfig, TrainConfig, check_activation_checkpointing
from lmforge.model.lora import adapter_plan, apply_lora, quantize_base
from lmforge.model.moe import expert_params
from lmforge.model.qat import apply_qat
from lmforge.model.wrap import linear_targets
from lmforge.parallel.comm_hooks import CommHook
from lmforge.parallel.data_parallel import apply_ddp, apply_fsdp
from lmforge.parallel.layout import SINGLE, Layout
from lmforge.parallel.materialize import Init, is_meta
from lmforge.parallel.materialize import materialize as materialize_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApplyContext:
    """What the stages read: the run's training settings, device, process layout, compute dtype, and how a
    meta-device model gets its values (``init``; None: the model given is already real)."""

    train: TrainConfig
    device: torch.device
    layout: Layout = SINGLE
    compute_dtype: torch.dtype = torch.float32
    init: Init | None = None
    lora: LoraConfig | None = None
    comm: CommHook | None = None  # DDP's gradient compression (parallel.ddp_comm_hook)
    qat: QATConfig | None = None


def can_compile(enabled: bool, device: torch.device) -> bool:
    """``train.compile``, unless on CPU without a C++ compiler (then a warning, and eager)."""
    if not enabled:
        return False
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        log.warning("train.compile: no C++ compiler found, running eager (install g++ to compile on CPU)")
        return False
    return True


def lora(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """``lora.rank > 0``: adapters on the target layers, the rest frozen (``lmforge/model/lora.py``); else
    unchanged."""
    if ctx.lora is None or ctx.lora.rank == 0:
        return module
    names = apply_lora(model, ctx.lora)
    log.info("lora: rank %d on %d layers (%s), the rest frozen", ctx.lora.rank, len(names), ctx.lora.targets)
    return module


def qat(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """``qat.enabled``: the target linear layers fake-quantize (``lmforge/model/qat.py``); else unchanged.
    They start switched off; ``train/callbacks/control.py`` switches them on from ``qat.start_step``."""
    if ctx.qat is None or not ctx.qat.enabled:
        return module
    from lmforge.model.qat import set_fake_quant

    names = apply_qat(model, ctx.qat.scheme, ctx.qat.group_size)
    set_fake_quant(model, ctx.qat.start_step == 0)
    log.info("qat: %s (group size %d) on %d layers", ctx.qat.scheme, ctx.qat.group_size, len(names))
    return module


def convert(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Module conversions: with ``train.precision = "fp8"``, torchao float8 training of the linear layers
    (``train.fp8_recipe``; ``lmforge/precision.py::convert_fp8``); with ``fp64`` the (meta) parameters
    become float64, before any later stage shards them; else unchanged."""
    if ctx.compute_dtype == torch.float64:
        module.to(torch.float64)
    if ctx.train.precision == "fp8":
        from lmforge.precision import convert_fp8

        layout = ctx.layout
        targets = set(linear_targets(model, "fp8"))
        convert_fp8(
            model, ctx.train.fp8_recipe, ctx.device, layout.kind == "fsdp", layout.degrees["tp"], targets
        )
    return module


def tensor_parallel(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Tensor parallelism over the ``tp`` mesh dimension (``lmforge/parallel/tensor.py``); else unchanged."""
    if ctx.layout.degrees["tp"] == 1:
        return module
    from lmforge.parallel.tensor import apply_tensor_parallel

    apply_tensor_parallel(model, ctx.layout.submesh("tp"))
    return module


def expert_parallel(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Expert parallelism over the ``ep`` ranks (``lmforge/parallel/expert.py``): the MoE layers' experts
    sharded on dim 0, their rows exchanged all-to-all; else unchanged."""
    if ctx.layout.ep == 1:
        return module
    from lmforge.parallel.expert import apply_expert_parallel

    apply_expert_parallel(model, ctx.layout.ep_mesh)
    return module


def _aten_ops(namespace: object, *names: str) -> frozenset:
    """The overload packets ``namespace.<name>`` that this torch build has (kernels differ by version)."""
    return frozenset(getattr(namespace, n) for n in names if hasattr(namespace, n))


# Selective checkpointing keeps the outputs of these ops and recomputes everything else in the block (norms,
# RoPE, activations, residual adds, views): matmuls and attention are the FLOPs, the rest is cheap
# element-wise work. ``nn.Linear`` reaches the dispatcher as mm / addmm (2-D) or bmm / baddbmm.
# A tensor-parallel reduce-scatter is kept too (as torchtitan does): recomputing it would repeat the
# communication, not just arithmetic.
SELECTIVE_SAVE = (
    _aten_ops(torch.ops.aten, "mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
    | _aten_ops(
        torch.ops.aten,
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    | _aten_ops(torch.ops._c10d_functional, "reduce_scatter_tensor")
)
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """MUST_SAVE for the ops of :data:`SELECTIVE_SAVE` (and FlexAttention), PREFER_RECOMPUTE otherwise."""
    if getattr(op, "overloadpacket", None) in SELECTIVE_SAVE or op is _FLEX:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# A block's forward draws no random numbers (no dropout), so the checkpoints do not save and restore the
# RNG state around the recomputation.
FULL = partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
SELECTIVE = partial(FULL, context_fn=partial(create_selective_checkpoint_contexts, selective_policy))


def block_runner(policy: str, index: int) -> Callable | None:
    """How block ``index`` (its place in the whole model) runs under ``train.activation_checkpointing``:
    ``None`` (plainly), :data:`FULL` (non-reentrant ``torch.utils.checkpoint``) or :data:`SELECTIVE`."""
    if policy == "none":
        return None
    if policy == "selective":
        return SELECTIVE
    if policy.startswith("every:"):
        return FULL if index % int(policy.removeprefix("every:")) == 0 else None
    return FULL  # full


def set_activation_checkpointing(model: nn.Module, policy: str) -> None:
    """Set every block's ``runner`` for ``policy`` (``none`` clears them); parameters are not touched."""
    for key, block in model.blocks.items():
        block.runner = block_runner(check_activation_checkpointing(policy), int(key))


def activation_checkpointing(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """``train.activation_checkpointing``: recompute block activations in backward.

    * ``full``: every block runs under non-reentrant ``torch.utils.checkpoint``: backward keeps only the
      block's inputs and recomputes its forward (one more forward of the blocks per step).
    * ``every:K``: block ``i`` is checkpointed when ``i % K == 0`` (one block in K, torchtitan's layer
      frequency; ``every:1`` is ``full``). Not Chen et al.'s segments of K blocks: a block's input is
      about 1/30 of what it saves inside, so checkpointing every block already keeps only O(L) small
      tensors, and a segment of K blocks would recompute K blocks' internals at once in backward,
      raising the peak.
    * ``selective``: every block runs under a checkpoint with PyTorch's selective checkpoint contexts:
      the outputs of matmuls and attention are saved (:data:`SELECTIVE_SAVE`), the element-wise ops
      recomputed.

    The checkpoint is set as each block's ``runner`` (``lmforge/model/transformer.py::Block``), an
    attribute read inside the block's forward: no wrapper module, so ``named_parameters()`` (optimizer
    groups, muP scales, checkpoint keys) are the same under every policy and a resume may change it; no
    method of the model is replaced. Tensor parallelism has sharded the blocks before; compile then traces
    the checkpoints (``torch.compile`` supports checkpoint and selective contexts), and FSDP2's hooks on
    each block stay outside the checkpointed region, as with torchtitan's wrapper.
    """
    policy = ctx.train.activation_checkpointing
    set_activation_checkpointing(model, policy)
    if policy != "none":
        n = sum(block.runner is not None for block in model.blocks.values())
        log.info("activation checkpointing: %s, %d of %d blocks", policy, n, len(model.blocks))
    return module


def activation_offload(enabled: bool) -> contextlib.AbstractContextManager:
    """``train.activation_offload``: the context a training step runs in. ``save_on_cpu(pin_memory=True)``
    moves every tensor saved for backward to pinned host memory as it is saved and back when backward
    needs it; else nothing.

    It wraps the whole step (``train/trainer.py``), not a stage's module: saved-tensor hooks inside a
    compiled region make Dynamo break the graph (``save_on_cpu`` is marked not traceable), and around the
    step they also cover DDP, FSDP2 and the pipeline schedule's forwards; the compiled objective's saved
    tensors go through them at run time. With checkpointing, what is saved is each checkpointed block's
    input (and selective's cached outputs stay on the device: they are not saved through hooks). CUDA only
    (``train/build.py`` refuses it elsewhere: on a CPU the activations already live in host memory); not
    run on this project's CPU machines.
    """
    return torch.autograd.graph.save_on_cpu(pin_memory=True) if enabled else contextlib.nullcontext()


COMPILE_OPTIONS: dict = {}  # torch.compile keyword arguments of the training objective (defaults measured best)


def compile_like_training(fn: Callable) -> Callable:
    """``torch.compile(fn, **COMPILE_OPTIONS)``: how the training objective is compiled (benchmarks compile
    their baselines through this too, so both sides get the same settings)."""
    return torch.compile(fn, **COMPILE_OPTIONS)


def compile_module(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """``torch.compile`` when ``train.compile`` (and the platform can): the whole objective in one process,
    each block in place in several."""
    if not can_compile(ctx.train.compile, ctx.device):
        return module
    if model.lm_head is not None:  # the fused loss runs outside the graph; its kernels compile alone
        model.lm_head.compile_loss(**COMPILE_OPTIONS)
    if ctx.layout.distributed:
        for block in model.blocks.values():
            block.compile(**COMPILE_OPTIONS)
        return module
    return compile_like_training(module)


def data_parallel(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """FSDP2 (blocks, then the objective) or DDP over the data-parallel ranks
    (``lmforge/parallel/data_parallel.py``), DDP with ``ctx.comm``'s gradient compression; one process:
    unchanged. DDP broadcasts rank 0's values when it
    wraps, so a meta model is materialised first (:func:`materialize`)."""
    kind = ctx.layout.kind
    # expert-parallel experts keep their own data parallelism (parallel/expert.py::ExpertGradSync)
    experts = set(expert_params(model)) if ctx.layout.ep > 1 else set()
    if kind == "fsdp":
        head = model.lm_head if model.lm_head is not None and not model.cfg.tie_embeddings else None
        blocks = list(model.blocks.values())
        return apply_fsdp(module, blocks, ctx.layout, ctx.compute_dtype, head, ignored=experts)
    if kind in ("ddp", "zero1"):
        real = materialize(module, model, ctx)
        return apply_ddp(real, ctx.layout, ctx.device, ignored=experts, comm=ctx.comm)
    return module


def materialize(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Storage and values for this rank's part of every parameter (``lmforge/parallel/materialize.py``:
    the single-process initialisation from ``train.seed``, one whole parameter at a time); a module
    already materialised passes through. Tensor parallelism's gradient-layout hooks are registered here,
    on the real parameters (tensor hooks do not survive ``to_empty``). LoRA's adapters are initialised
    after the whole base (``model/lora.py::adapter_plan``); QLoRA's frozen weights are then quantised."""
    if ctx.init is None or not is_meta(module):
        return module
    init = dataclasses.replace(ctx.init, plan=ctx.init.plan + tuple(adapter_plan(model)))
    if ctx.layout.offload:  # FSDP2's CPU offload: the shards live in host memory from the start
        init = dataclasses.replace(init, storage=torch.device("cpu"))
    materialize_model(module, model, init)
    if ctx.lora is not None and ctx.lora.rank and ctx.lora.quantize == "nf4":
        quantize_base(model)
    if ctx.layout.degrees["tp"] > 1:
        from lmforge.parallel.tensor import register_grad_layout_hooks

        register_grad_layout_hooks(model)
    return module


STAGES: tuple[tuple[str, Callable[[nn.Module, ApplyContext], nn.Module]], ...] = (
    ("lora", lora),
    ("qat", qat),
    ("convert", convert),
    ("tensor_parallel", tensor_parallel),
    ("expert_parallel", expert_parallel),
    ("activation_checkpointing", activation_checkpointing),
    ("compile", compile_module),
    ("data_parallel", data_parallel),
    ("materialize", materialize),
)


def apply(module: nn.Module, model: nn.Module, ctx: ApplyContext) -> nn.Module:
    """Every stage of :data:`STAGES`, in order, to ``module`` (what the training step calls: ``model`` and
    its loss, or a pipeline stage, which is ``model`` itself); returns it transformed."""
    for _, stage in STAGES:
        module = stage(module, model, ctx)
    return module
