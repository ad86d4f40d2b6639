"""Tensor parallelism with sequence parallelism (Megatron-style) over one mesh dimension.

Why this layout: a block's two sublayers each start with a column-parallel projection (q/k/v, or
gate/up / fc_in) and end with a row-parallel one (o_proj, or down_proj / fc_out), so every rank keeps
``1 / tp`` of each matrix and of the attention heads / MLP channels, and the only communication per
sublayer is one all-gather going in and one reduce-scatter going out (their mirror images in backward).
Between the sublayers, in the residual stream and the norms, activations are sharded along the sequence
dimension (sequence parallelism; V. Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, arXiv:2205.05198), so norms and residual adds run on ``T / tp`` tokens and
activation memory there is divided by ``tp`` too, at no extra communication: an all-reduce is exactly
a reduce-scatter followed by an all-gather, split across the norm.

Layout of one rank (``b`` batch, ``t`` sequence, ``d`` model width, ``h`` heads):

* ``embed``: rows (vocabulary) sharded; the partial embedding sums are reduce-scattered into the
  sequence-sharded residual stream ``(b, t / tp, d)``. GPT-2's ``pos_embed`` is sharded by rows
  (positions) the same way, so its reduce-scatter yields exactly the positions of this rank's tokens.
* each block: ``attn_norm`` / ``mlp_norm`` on the sequence shard (weights replicated); the attention
  and MLP inputs are all-gathered to ``(b, t, d)``; q/k/v column-parallel (``h / tp`` query heads,
  ``n_kv_heads / tp`` key/value heads: GQA groups never straddle ranks because both counts are
  divided by ``tp`` and query head ``i`` uses key/value head ``i // (h / n_kv)``); ``o_proj`` and
  ``down_proj`` / ``fc_out`` row-parallel, reduce-scattered back to the sequence shard. RoPE tables and
  the document mask are full-sequence and replicated: attention sees every position of its heads.
* ``norm`` on the sequence shard; the root's output is all-gathered into an ordinary full tensor
  ``(b, t, d)``, so every TP rank sees every token's final hidden state.
* ``lm_head`` (``model/head.py::OutputHead``): its weight sharded by vocabulary rows (``Shard(0)``,
  :class:`VocabParallelHead`), and no hook on its call. The training loss is computed
  vocabulary-parallel on each rank's ``V / tp`` rows (loss parallelism, always on when ``tp > 1``; below),
  so no ``b x t x V`` logits are ever gathered in training; ``Transformer.logits()`` (sampling,
  evaluation, muP checks) gathers the full logits. With ``model.tie_embeddings`` both ``embed.weight``
  and ``lm_head.weight`` are ``Shard(0)`` of the same ``(vocab, d)`` matrix, so they are tied again after
  parallelising and stay one parameter.

A head a subclass adds on the root's full hidden states (PPO's value head, ``posttrain/ppo.py``) is
replicated on every rank and reads its local tensors.

Every parameter ends up a DTensor on the TP mesh (``Shard`` for the projections and embeddings,
``Replicate`` for norms and row-parallel biases), so FSDP2's ``fully_shard`` over the data-parallel
dimension of the same 2-D mesh composes, and ``get_total_norm`` over the gradients followed by
``full_tensor()`` is the global norm. Gradients are given their parameter's layout once accumulated (a
hook per parameter): DTensor's backward leaves the replicated norm weights with ``Partial`` gradients
(per-rank sums over the rank's tokens), which code reading local shards would mistake for whole values,
and which DTensor-aware code (AdamW, ``get_total_norm``, clipping) would all-reduce at every use. Tensor
hooks do not survive ``to_empty`` (``Transformer.materialize``): ``swap_tensors`` keeps the Python-side
hook but not its registration, so a model parallelised on the meta device gets them after it is
materialised (:func:`register_grad_layout_hooks`, called by the build's ``materialize`` stage).

FP8: layers converted to torchao's float8 (``train.precision = "fp8"``, converted before this plan is
applied) take torchao's float8 styles where they can (:func:`_tp_styles`): tensorwise scaling on a
backend that all-gathers float8 (NCCL; not gloo, :func:`float8_collectives`); elsewhere PyTorch's styles,
with the same float8 values computed inside each layer. The output head is never converted.

Weights: a model parallelised on the meta device is materialised and initialised afterwards by
``lmforge/parallel/materialize.py`` (each rank draws every whole parameter in the single-process order
and keeps its shard); a real model must hold the same values on every rank beforehand (the same seed or
checkpoint; shards are cut from the first rank's copy). Initialising a sharded model with DTensor's
random ops is not the same: they follow the global RNG per shard only on CUDA, so on CPU every rank
draws the same values for its shard (duplicated heads).

Loss parallelism: ``model/fused_loss.py`` computes the head and the cross-entropy fused, chunk by
chunk, on this rank's vocabulary rows; per chunk of ``c`` tokens the row maxima (``c`` FP32 values,
MAX) and then the sums of exponentials with the target logits (``2 c`` FP64 values, SUM) are
all-reduced over the TP group in forward (backward reuses the saved log-sum-exp), and the hidden-state
gradient (a partial sum over each rank's rows) is all-reduced once, ``N x d`` in FP32. Against the
former layout (a column-parallel head whose logits were all-gathered so that every rank computed the
whole cross-entropy) this removes the ``(tp - 1) / tp x N x V`` all-gather and the full-vocabulary
softmax on every rank; the loss equals the replicated one within 1e-6 in FP32
(``tests/distributed/fused_loss_worker.py`` counts the collectives of both). It needs no context
manager and returns an ordinary tensor, the same on every TP rank. PyTorch's ``loss_parallel()``
(vocabulary-sharded logits into ``F.cross_entropy``) is not used: it needs the logits of a chunk as a
DTensor and keeps its log-softmax for backward, which the fused loss exists to avoid.

Sequence lengths: every forward's sequence length must be a multiple of ``tp`` (training sequences of
``data.seq_len`` are checked by :func:`check_tensor_parallel`; anything shorter, such as sampling from
a prompt, must use an unparallelised model or pad).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.moe import MoE
from lmforge.model.transformer import Transformer, ff_width


def sharded_sizes(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> dict[str, int]:
    """Every size tensor parallelism splits into ``tp`` equal parts, by the config key that sets it (MoE
    with shared experts: their hidden width, ``shared_experts x d_expert``)."""
    sizes = {
        "model.n_heads": model_cfg.n_heads,
        "model.n_kv_heads": model_cfg.n_kv_heads or model_cfg.n_heads,
        "model.d_ff": ff_width(model_cfg),
        "data.vocab_size": vocab_size,
        "data.seq_len": seq_len,
    }
    m = model_cfg.moe
    if m.experts and m.shared_experts:
        sizes["model.moe.shared_experts"] = m.shared_experts * (m.d_expert or ff_width(model_cfg))
    return sizes


def valid_tp_sizes(model_cfg: ModelConfig, vocab_size: int, seq_len: int, limit: int = 64) -> list[int]:
    """The TP sizes in ``2..limit`` that divide every size of :func:`sharded_sizes`."""
    sizes = sharded_sizes(model_cfg, vocab_size, seq_len).values()
    return [tp for tp in range(2, limit + 1) if all(size % tp == 0 for size in sizes)]


def check_tensor_parallel(model_cfg: ModelConfig, vocab_size: int, seq_len: int, tp: int) -> None:
    """Raise :class:`ConfigError` (one line: the key and the fix) unless ``tp`` ranks can shard this model.

    Query heads, key/value heads and MLP channels are split across ranks, the vocabulary is split for
    the embedding and the output head, and sequence parallelism splits the training sequence: each must
    be a multiple of ``tp``. ``vocab_size`` is the tokenizer's (``data.vocab_size`` when lmforge trains
    it). Tied embeddings need nothing (both halves are sharded alike). No process group is needed.
    """
    if tp < 1:
        raise ConfigError(f"parallel.tp: {tp} must be at least 1")
    if tp == 1:
        return
    good = valid_tp_sizes(model_cfg, vocab_size, seq_len)
    other_tp = f"parallel.tp {' or '.join(map(str, good[:2]))}" if good else "parallel.tp 1"
    sizes = sharded_sizes(model_cfg, vocab_size, seq_len)
    for key in ("model.n_heads", "model.n_kv_heads"):
        if sizes[key] % tp:
            raise ConfigError(f"parallel.tp: {tp} does not divide {key} ({sizes[key]}); use {other_tp}")
    if sizes["model.d_ff"] % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the MLP width ({sizes['model.d_ff']}); use {other_tp}, "
            f"or set model.d_ff to a multiple of {tp}"
        )
    shared = sizes.get("model.moe.shared_experts", 0)
    if shared % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the shared experts' width (model.moe.shared_experts x d_expert "
            f"= {shared}), which tensor parallelism splits; use {other_tp}, or set model.moe.d_expert to a "
            f"multiple of {tp}"
        )
    if vocab_size % tp:
        raise ConfigError(
            f"data.vocab_size: the vocabulary ({vocab_size} tokens) is not divisible by parallel.tp ({tp}); "
            f"use a vocabulary of a multiple of {tp} tokens such as {_round_up(vocab_size, tp)}, or {other_tp}"
        )
    if seq_len % tp:
        raise ConfigError(
            f"data.seq_len: {seq_len} is not divisible by parallel.tp ({tp}) (sequence parallelism splits "
            f"the sequence); use a multiple of {tp} such as {_round_up(seq_len, tp)}, or {other_tp}"
        )


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def float8_collectives(mesh: DeviceMesh) -> bool:
    """Whether ``mesh``'s backend all-gathers float8 tensors: NCCL does (it moves float8 as bytes, PyTorch
    maps the float8 dtypes to ``ncclUint8`` for all-gathers); gloo does not (torch 2.13's
    ``ProcessGroupGloo`` dispatches on a list of dtypes without float8 and raises "Invalid scalar type")."""
    import torch.distributed as dist

    return dist.get_backend(mesh.get_group()) != "gloo"


def _tp_styles(layers: list[nn.Module], float8_comm: bool) -> tuple[type, type, type]:
    """The column-parallel, row-parallel and input-preparing styles for ``layers`` (linear layers fed by
    one input): torchao's float8 styles when every one of them is a float8 layer of tensorwise scaling
    and ``float8_comm`` (the mesh's backend can move float8 data), PyTorch's plain ones otherwise.

    The float8 styles cast a layer's input to float8 before its all-gather (``PrepareFloat8ModuleInput``
    casts the attention's or the MLP's input once for all its projections) and its output gradient
    before the reduce-scatter going back, so those collectives move one byte per value instead of two
    (BF16) or four (the FP32 residual stream). Each cast scales by the amax of the whole tensor (an
    all-reduce over the mesh), as one process's does; it casts the FP32 norm output directly, where the
    layer under autocast first rounds it to BF16 (measured: 3.7e-4 relative loss difference from one
    process over 3 steps, 1.2e-4 with plain styles; ``tests/distributed/fp8_meta_worker.py``). With plain
    styles on a float8 layer (the rowwise recipes, whose scales are per row and which torchao's styles
    do not take, or a backend without float8 collectives) the casts happen after the gather, inside the
    layer, on the whole tensor, as in one process; the gather moves the input's own dtype."""
    if float8_comm and layers and all(_tensorwise_float8(layer) for layer in layers):
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def _tensorwise_float8(layer: nn.Module) -> bool:
    """Whether ``layer`` is a torchao float8 layer (the FP8 ``convert`` stage's) with tensorwise scaling
    of its input, weight and output gradient."""
    if type(layer).__name__ != "Float8Linear":  # torchao is imported only where FP8 is used
        return False
    from torchao.float8.config import ScalingGranularity

    c = layer.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE for cast in casts)


def _block_plan(
    model: Transformer, float8_comm: bool = True, block: nn.Module | None = None
) -> dict[str, object]:
    """Plan of ``block`` (default: the first), relative to the block: sequence-parallel norms, heads /
    channels split; an MoE block's feed-forward by :func:`_moe_plan`. Layers converted to float8
    (tensorwise) take torchao's float8 styles (:func:`_tp_styles`); ``float8_comm``: whether the TP
    mesh's backend can all-gather float8 data."""
    seq, full = Shard(1), Replicate()
    block = block if block is not None else next(iter(model.blocks.values()))
    attn = [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj]
    attn_out = block.attn.o_proj
    col, _, prepare = _tp_styles(attn, float8_comm)
    _, row, _ = _tp_styles([attn_out], float8_comm)
    plan: dict[str, object] = {
        "attn_norm": SequenceParallel(),
        "attn": prepare(
            input_layouts=(seq, None, None, None), desired_input_layouts=(full, None, None, None)
        ),
        "attn.q_proj": col(),
        "attn.k_proj": col(),
        "attn.v_proj": col(),
        "attn.o_proj": row(output_layouts=seq),
        "mlp_norm": SequenceParallel(),
    }
    if isinstance(block.mlp, MoE):
        return plan | _moe_plan(block.mlp)
    mlp_in = [block.mlp.gate_proj, block.mlp.up_proj] if model.cfg.arch == "llama" else [block.mlp.fc_in]
    mlp_out = block.mlp.down_proj if model.cfg.arch == "llama" else block.mlp.fc_out
    col, _, prepare = _tp_styles(mlp_in, float8_comm)
    _, row, _ = _tp_styles([mlp_out], float8_comm)
    plan["mlp"] = prepare(input_layouts=(seq,), desired_input_layouts=(full,))
    names = ("gate_proj", "up_proj", "down_proj") if model.cfg.arch == "llama" else ("fc_in", "fc_out")
    plan |= {f"mlp.{n}": col() for n in names[:-1]} | {f"mlp.{names[-1]}": row(output_layouts=seq)}
    return plan


def _moe_plan(moe: MoE) -> dict[str, object]:
    """An MoE block's feed-forward (``model/moe.py``) under TP, relative to the block. The layer's input
    is all-gathered into the whole ``(b, t, d)`` tensor, as a dense MLP's is; the router and the routed
    experts are replicated on every TP rank (:class:`ReplicateParameters`), so each rank routes every
    token and runs the experts on all of them, the same work and numbers as one process; the output is
    cut back to this rank's sequence shard (no communication; its gradient is all-gathered in backward).
    The shared experts (one SwiGLU every token takes) are split like a dense MLP, column-parallel in and
    row-parallel out, their partial sums all-reduced into the whole output."""
    seq, full = Shard(1), Replicate()
    plan: dict[str, object] = {
        "mlp": PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(full,),
            use_local_input=True,
            output_layouts=(full,),
            desired_output_layouts=(seq,),
            use_local_output=True,
        ),
        "mlp.router": ReplicatedLinear(),
        "mlp.experts": ReplicateParameters(),
    }
    if moe.shared is not None:
        plan |= {
            "mlp.shared.gate_proj": ColwiseParallel(),
            "mlp.shared.up_proj": ColwiseParallel(),
            "mlp.shared.down_proj": RowwiseParallel(output_layouts=full),
        }
    return plan


class ReplicateParameters(ParallelStyle):
    """Every parameter of the module a ``Replicate`` DTensor on the TP mesh (the same values on every
    rank, one set of them in norms and checkpoints, FSDP2 shards it over the data-parallel ranks) and no
    hook: the module's forward reads the local tensors (``model/moe.py``), and their gradients, computed
    from every token on every rank, are whole on each."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            full = distribute_tensor(param.data, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(full, requires_grad=param.requires_grad))
        return module


class ReplicatedLinear(ReplicateParameters):
    """A linear layer replicated over the TP mesh (:class:`ReplicateParameters`) that is called through its
    own forward with local tensors (the MoE router, ``model/moe_routing.py::router_logits``, and whatever
    LoRA or QAT made of it): its input becomes a ``Replicate`` DTensor on the way in and its output the
    local tensor on the way out, so every rank computes the whole product, as one process does, with no
    communication in forward or backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def to_dtensor(_module, args):
            return tuple(
                DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(
            lambda _m, _args, out: out.to_local() if isinstance(out, DTensor) else out
        )
        return module


class VocabParallelHead(ParallelStyle):
    """The output head's layout: its weight ``Shard(0)`` (vocabulary rows, as ``ColwiseParallel`` shards
    a linear layer) and nothing else. Unlike ``ColwiseParallel`` it registers no input or output hook:
    the head's own forward (``model/head.py``) takes the replicated hidden states and the targets as
    they are and computes the loss vocabulary-parallel, or gathers logits when asked for them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._shard_rows)

    def _shard_rows(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        weight = module.weight
        sharded = distribute_tensor(weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=weight.requires_grad))


# the transformer's own parts, each with its place in the plan; any other child with parameters is a head
# a subclass adds on the root's full hidden states (``posttrain/ppo.py``'s value head): replicated
_PLANNED = frozenset({"embed", "pos_embed", "blocks", "norm", "lm_head"})


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> Transformer:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (layout in the module docstring); returns it.

    Every rank must hold the same initialised (or loaded) weights beforehand; see the module docstring
    for why not to initialise afterwards. Works on a meta-device model too (to load a sharded
    checkpoint into, or materialised shard by shard). Pipeline stages cut by ``keep_stage`` work too: a
    stage without the embedding takes full hidden states and scatters them itself. The output head is
    vocabulary-sharded and its loss vocabulary-parallel (the module docstring). Any other child module
    with parameters (a head a subclass adds on the full hidden states, such as PPO's value head) is
    replicated (:class:`ReplicateParameters`): its forward must read the local tensors.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D TP mesh, got {tp_mesh.ndim} dimensions")
    tp = tp_mesh.size()
    check_tensor_parallel(model.cfg, model.vocab_size, model.max_seq_len, tp)
    tied = (
        model.embed is not None and model.lm_head is not None and model.lm_head.weight is model.embed.weight
    )
    seq, full = Shard(1), Replicate()

    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, _block_plan(model, float8_collectives(tp_mesh), block))

    plan: dict[str, object] = {}
    if model.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=full, output_layouts=seq)
        if model.pos_embed is not None:  # positions (t, d): their sequence dimension is 0
            plan["pos_embed"] = RowwiseParallel(input_layouts=full, output_layouts=Shard(0))
    elif model.blocks:  # a later pipeline stage receives full hidden states: keep this rank's tokens
        first = next(iter(model.blocks))
        plan[f"blocks.{first}"] = PrepareModuleInput(
            input_layouts=(full, None, None, None),
            desired_input_layouts=(seq, None, None, None),
            use_local_output=True,
        )
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.lm_head is not None:
        plan["lm_head"] = VocabParallelHead()
    for name, child in model.named_children():  # a task's head on the full hidden states (PPO's value head)
        if name not in _PLANNED and any(True for _ in child.parameters()):
            plan[name] = ReplicateParameters()
    parallelize_module(model, tp_mesh, plan)
    # the root returns the full hidden states (b, t, d) as an ordinary tensor, replicated over TP
    parallelize_module(model, tp_mesh, PrepareModuleOutput(output_layouts=seq, desired_output_layouts=full))
    if tied:  # both halves are Shard(0) of the same (vocab, d) matrix: one parameter again
        model.lm_head.weight = model.embed.weight
    model.register_forward_pre_hook(_check_length(tp))
    if not any(p.device.type == "meta" for p in model.parameters()):  # see the module docstring
        register_grad_layout_hooks(model)
    return model


def register_grad_layout_hooks(model: nn.Module) -> None:
    """Give every parameter's gradient its parameter's layout once accumulated (:func:`_grad_like_param`).
    A model parallelised on the meta device calls this after materialisation (``parallel/apply.py``)."""
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(_grad_like_param)


def _grad_like_param(param: nn.Parameter) -> None:
    """Give a gradient its parameter's layout once accumulated: DTensor backward leaves the replicated
    norm weights with ``Partial`` (per-rank partial sums over the sequence shard) gradients; reducing
    them here means the optimizer, clipping and checkpointing see exactly one layout per parameter."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _check_length(tp: int) -> Callable[[nn.Module, tuple], None]:
    """Forward pre-hook: a clear error for sequence lengths sequence parallelism cannot split."""

    def hook(module: nn.Module, args: tuple) -> None:
        t = args[0].shape[1]
        if t % tp:
            raise ValueError(
                f"sequence of {t} tokens cannot be split over {tp} tensor-parallel ranks; "
                f"use a multiple of {tp} (sequence parallelism shards the sequence)"
            )

    return hook
