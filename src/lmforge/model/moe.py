"""Mixture of experts: a block's MLP replaced by routed SwiGLU experts (``model.moe``, docs/moe.md).

Token-choice top-k routing. For the ``T`` tokens of a micro-batch (rows of ``x``, width ``d``) the router
computes logits ``z = x W_r^T`` (FP32, ``E`` experts), scores ``s = softmax(z)`` or ``s = sigmoid(z)``,
picks each token's ``k`` experts by ``topk(s + b)`` (``b``: the balancing bias, zero unless
``model.moe.bias_update_rate``; it only chooses, it never weighs) and weighs expert ``e``'s output by
``s_e`` (divided by the chosen scores' sum with ``normalize``). The token's output is
``sum_chosen g_e SwiGLU_e(x) (+ the shared experts' SwiGLU(x))``.

The experts' weights are 3-D parameters ``[experts, d_in, d_out]`` (``gate_proj``, ``up_proj``,
``down_proj``), so expert parallelism can shard dim 0. The assignments are sorted by expert and each
projection is one grouped matrix product over the groups (``torch._grouped_mm``: CPU in FP32, BF16,
FP16 with rows of a multiple of 16 bytes; torch 2.13), or a loop of one matmul per expert where that
kernel is missing (``train.moe_kernel``); both give the same numbers (``tests/test_moe.py``). Under
expert parallelism (``parallel.ep``) the rows go to the experts' ranks and back through the layer's
``exchange`` (``parallel/expert.py::ExpertExchange``, set from outside); routing stays here. Under tensor
parallelism the router and the routed experts are replicated over the TP ranks and the layer gets the
whole gathered input (``parallel/tensor.py::_moe_plan``): the forward reads their local tensors.

Capacity (``capacity_factor > 0``, training only: evaluation and generation are dropless): each expert
takes at most ``C = floor(factor * T * k / E)`` assignments of a micro-batch, in priority order: every
token's first choice before any second choice, then by token position; the rest are dropped (the token
keeps its other experts and the residual) and counted.

Balancing, each term's coefficient in ``model.moe`` (the losses are averaged over the step's micro-batches
by the training module and added to the loss; a pipeline stage carries its layers' losses on its output,
:func:`carry_aux_loss`; formulas in the functions below): the Switch/GShard loss
(:func:`switch_aux_loss`), DeepSeek-V3's sequence-wise loss (:func:`sequence_aux_loss`), the router
z-loss (:func:`router_z_loss`), and auxiliary-loss-free balancing (:func:`update_bias`, run after each
optimizer step by :func:`register_balance_step`).

What each MoE layer counts during a training step (non-persistent buffers, restarted by
:func:`start_step` at a step's first micro-batch, read by :func:`moe_metrics`): tokens routed to each
expert, dropped assignments, router entropy and the raw balance losses. A forward recomputed by
activation checkpointing in backward counts nothing twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.config import Config, ModelConfig
from lmforge.errors import ConfigError

KERNELS = ("auto", "grouped_mm", "loop")
LOSSES = ("aux_loss", "seq_aux_loss", "z_loss")  # the order of MoE.sums' first entries


def min_capacity_factor(tokens: int, k: int, experts: int) -> float:
    """The smallest ``capacity_factor`` that leaves each expert one slot: ``floor(f T k / E) >= 1`` holds
    exactly when ``f >= E / (T k)`` (``T`` tokens of a training micro-batch on one rank)."""
    return experts / (tokens * k)


def check_moe(cfg: Config, chunks: int = 1) -> None:
    """An MoE recipe against what the layer supports, before any work (one line naming the key):
    ``parallel.ep`` dividing the experts, expert groups inside one pipeline stage, capacity for at least
    one token per expert in each of the ``chunks`` parts a micro-batch runs as (a pipeline's microbatches,
    computed by ``parallel/model_layout.py``), and no mode it does not
    handle yet (the zero-bubble pipeline schedules, FP8, DPO)."""
    m, ep = cfg.model.moe, cfg.parallel.ep
    if ep > 1 and not m.experts:
        raise ConfigError(
            f"parallel.ep: {ep} splits the experts of MoE layers, and this model has none; set "
            "model.moe.experts or parallel.ep = 1"
        )
    if not m.experts:
        return
    if m.experts % ep:
        raise ConfigError(
            f"parallel.ep: {ep} does not divide model.moe.experts ({m.experts}); choose an ep that divides the "
            "number of experts"
        )
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    if ep > 1 and cfg.parallel.pp > 1 and dp % ep:
        raise ConfigError(
            f"parallel.ep: an expert group of {ep} ranks would span pipeline stages (each of the "
            f"parallel.pp = {cfg.parallel.pp} stages has dp_replicate x dp_shard = {dp} ranks); set "
            f"--parallel.dp_shard to a multiple of {ep} so every expert group sits inside one stage"
        )
    if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in ("zero_bubble", "zbv"):
        raise ConfigError(
            f"parallel.pp_schedule: {cfg.parallel.pp_schedule} splits the backward into input and weight "
            "gradients, which MoE balance losses are not verified under; use gpipe, 1f1b or "
            "interleaved_1f1b with model.moe"
        )
    mbs = cfg.train.micro_batch_size
    if m.capacity_factor and mbs != "auto":
        tokens = mbs * cfg.data.seq_len // chunks
        least = min_capacity_factor(tokens, m.top_k, m.experts)
        if m.capacity_factor < least:
            raise ConfigError(
                f"model.moe.capacity_factor: {m.capacity_factor:g} leaves each expert floor(factor x {tokens} "
                f"tokens x top_k {m.top_k} / {m.experts} experts) = 0 slots per micro-batch; use at least "
                f"{least:.4g} (experts / (tokens x top_k)), or 0 for dropless routing"
            )
    refused = {
        "train.precision": (
            cfg.train.precision == "fp8",
            "fp8 converts linear layers, not the experts' grouped weights; use bf16 with model.moe",
        ),
        "train.objective": (
            cfg.train.objective == "dpo",
            "dpo does not add MoE balance losses yet; use lm or sft",
        ),
    }
    for key, (bad, fix) in refused.items():
        if bad:
            raise ConfigError(f"{key}: with model.moe.experts > 0, {fix}")


# -- routing (pure) ----------------------------------------------------------------------------------


def router_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """``softmax(z)`` over the experts or ``sigmoid(z)`` per expert, in FP32."""
    logits = logits.float()
    return logits.softmax(-1) if score == "softmax" else logits.sigmoid()


def score_distribution(scores: torch.Tensor, score: str) -> torch.Tensor:
    """The scores as a distribution over the experts: softmax's as they are, sigmoid's divided by their
    sum over the experts (``s_i / sum_j s_j``, as DeepSeek-V3's balance loss normalises them)."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def route(
    scores: torch.Tensor, k: int, normalize: bool, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-choice top-k: ``experts = topk(s + b, k)`` (``(T, k)``, best first), ``weights = s`` at
    those experts, divided by their sum when ``normalize``. The bias ``b`` changes the choice only."""
    choice = scores if bias is None else scores + bias
    experts = choice.topk(k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights


def expert_capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Assignments one expert takes: ``floor(factor * tokens * k / experts)``; ``factor = 0``: ``tokens``
    (dropless: a token is never sent twice to one expert, so no expert gets more)."""
    if factor == 0:
        return tokens
    return math.floor(factor * tokens * k / experts + 1e-9)


def keep_mask(experts: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments of ``experts`` (``(T, k)``) fit in the experts' ``capacity``: an expert takes
    them in priority order, all first choices (by token position) before all second choices, and so on."""
    t, k = experts.shape
    slot_major = experts.t().reshape(-1)
    onehot = F.one_hot(slot_major, n_experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place in the expert's queue
    return (position < capacity).view(k, t).t()


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert (FP32, ``(E,)``) of ``experts`` (any shape of expert ids)."""
    flat = experts.reshape(-1)
    return torch.zeros(n_experts, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32)
    )


# -- balance losses and the bias rule (pure) ------------------------------------------------------------


def switch_aux_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer / GShard load-balancing loss over a micro-batch's ``T`` tokens:
    ``L = E * sum_i f_i P_i`` with ``f_i = (assignments to i) / (T k)`` (not differentiable) and
    ``P_i = mean_t p_t,i`` (``probs``: :func:`score_distribution`, ``(T, E)``). 1 when both are uniform."""
    t, k = experts.shape
    f = expert_counts(experts, n_experts) / (t * k)
    return n_experts * (f * probs.mean(0)).sum()


def sequence_aux_loss(probs: torch.Tensor, experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the ``B`` sequences: per sequence of ``S``
    tokens ``L = sum_i f_i P_i`` with ``f_i = E / (k S) * (assignments to i in the sequence)`` and
    ``P_i = mean_t p_t,i`` over the sequence (``probs`` ``(B, S, E)``, ``experts`` ``(B, S, k)``)."""
    b, s, k = experts.shape
    counts = torch.zeros(b, n_experts, device=experts.device).scatter_add_(
        1, experts.reshape(b, -1), torch.ones(b, s * k, device=experts.device)
    )
    f = counts * n_experts / (k * s)
    return (f * probs.mean(1)).sum(-1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: ``mean_t (log sum_i exp z_t,i)^2`` (keeps the router logits small)."""
    return torch.logsumexp(logits.float(), -1).square().mean()


def router_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``-sum_i p_i log p_i`` (nats; ``log E`` at most)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """``max_i load_i / mean_i load_i`` (1: perfectly balanced, ``E``: one expert takes all)."""
    return load.max() / load.mean().clamp_min(1e-30)


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): ``b_i += u * sign(mean_j load_j - load_i)``, in
    place: an overloaded expert's bias falls, an underloaded one's rises."""
    bias.add_(rate * torch.sign(load.mean() - load))


# -- the experts' matrix products -----------------------------------------------------------------------


def grouped_mm_fits(device: torch.device, dtype: torch.dtype, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs here: on a CPU FP32 / BF16 / FP16 with every row a multiple of 16
    bytes (measured, torch 2.13); on CUDA assumed for BF16 on compute capability 9.0 or newer only (the
    kernel's documented case; not yet run on a GPU here, so ``train.moe_kernel = "loop"`` is the way out)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if any(d * torch.finfo(dtype).bits // 8 % 16 for d in dims):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


@torch.compiler.disable
def _eager_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` outside the compiled graph (a graph break where its dtype cannot be traced)."""
    return torch._grouped_mm(x, w, offs=offs)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, kernel: str) -> torch.Tensor:
    """``x`` (``(N, d_in)``, rows sorted by group) times each group's matrix of ``w``
    (``(G, d_in, d_out)``): rows ``counts[:g].sum()`` onwards ``counts[g]`` rows use ``w[g]``; rows past
    ``counts.sum()`` belong to the last group. ``kernel``: ``grouped_mm`` or ``loop``."""
    if kernel == "grouped_mm":
        offs = counts.cumsum(0).to(torch.int32)
        offs = torch.cat([offs[:-1], offs.new_full((1,), x.shape[0])])
        if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
            return _eager_grouped_mm(x, w, offs)  # torch 2.13's meta kernel takes BF16 only
        return torch._grouped_mm(x, w, offs=offs)
    sizes = counts.tolist()
    sizes[-1] = x.shape[0] - sum(sizes[:-1])
    return torch.cat([part @ w[g] for g, part in enumerate(x.split(sizes))])


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts ``down(silu(gate(x)) * up(x))`` as 3-D parameters ``[n, d_in, d_out]``."""

    def __init__(self, n: int, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, d_model, hidden))
        self.up_proj = nn.Parameter(torch.empty(n, d_model, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, d_model))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, kernel: str) -> torch.Tensor:
        """``x`` rows sorted by expert, ``counts`` rows per expert (see :func:`grouped_matmul`)."""
        dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        if kernel == "auto":
            d, h = self.down_proj.shape[2], self.down_proj.shape[1]
            kernel = "grouped_mm" if grouped_mm_fits(x.device, dtype, d, h) else "loop"
        x = x.to(dtype)
        # under expert parallelism the weights are DTensors: this rank's experts are their local shard
        weights = (self.gate_proj, self.up_proj, self.down_proj)
        gate, up, down = ((p.to_local() if isinstance(p, DTensor) else p).to(dtype) for p in weights)
        with torch.autocast(x.device.type, enabled=False):
            h = F.silu(grouped_matmul(x, gate, counts, kernel)) * grouped_matmul(x, up, counts, kernel)
            return grouped_matmul(h, down, counts, kernel)


def _recomputing() -> bool:
    """A forward run again by activation checkpointing inside backward (eager): count nothing twice.
    Compiled code never reruns the Python forward."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """An MoE block's feed-forward: router, routed experts, optional shared experts (see the module
    docstring). ``aux_loss`` holds the weighted balance losses of the last training forward (a graph
    tensor, or None) until :func:`take_aux_loss` takes it."""

    def __init__(self, cfg: ModelConfig, hidden: int, kernel: str = "auto", shared: nn.Module | None = None):
        super().__init__()
        m = cfg.moe
        self.n_experts, self.top_k, self.score, self.kernel = m.experts, m.top_k, m.score, kernel
        self.normalize = m.normalize if m.normalize is not None else m.score == "sigmoid"
        self.capacity_factor, self.bias_rate = m.capacity_factor, m.bias_update_rate
        self.coefficients = {"aux_loss": m.aux_loss, "seq_aux_loss": m.seq_aux_loss, "z_loss": m.z_loss}
        self.router = nn.Linear(cfg.d_model, m.experts, bias=False)
        self.experts = GroupedExperts(m.experts, cfg.d_model, m.d_expert or hidden)
        self.shared = shared  # the shared experts: one SwiGLU every token goes through (or None)
        # how the experts run under expert parallelism (parallel/expert.py::ExpertExchange); None: here
        self.exchange = None
        self.register_buffer("expert_bias", torch.zeros(m.experts))  # persistent: checkpoints keep it
        # this step's counters: load per expert; [aux, seq_aux, z, entropy, dropped, forwards]
        self.register_buffer("load", torch.zeros(m.experts), persistent=False)
        self.register_buffer("sums", torch.zeros(6), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def reset_buffers(self) -> None:
        """Zero the bias and the counters (after ``to_empty``; a checkpoint then loads the bias)."""
        for buf in (self.expert_bias, self.load, self.sums):
            buf.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, flat = x.shape, x.reshape(-1, x.shape[-1])
        t, k, e = flat.shape[0], self.top_k, self.n_experts
        router = self.router.weight  # under tensor parallelism a Replicate DTensor: the whole matrix here
        router = router.to_local() if isinstance(router, DTensor) else router
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(flat.float(), router.float())
        scores = router_scores(logits, self.score)
        experts, weights = route(scores, k, self.normalize, self.expert_bias if self.bias_rate else None)
        capacity = expert_capacity(t, k, e, self.capacity_factor if self.training else 0.0)
        keep = keep_mask(experts, e, capacity) if capacity < t else None
        key = experts.reshape(-1) if keep is None else torch.where(keep.reshape(-1), experts.reshape(-1), e)
        order = key.argsort(stable=True)
        token = order // k
        counts = torch.zeros(e + 1, dtype=torch.long, device=x.device).index_add_(
            0, key, torch.ones_like(key)
        )
        if self.exchange is None:
            ys = self.experts(flat[token], counts[:e], self.kernel).float()
        else:
            ys = self.exchange(self.experts, flat[token], counts, self.kernel).float()
        w = weights.reshape(-1)[order]
        if keep is not None:  # dropped assignments ran with the last expert: weight 0
            w = torch.where(keep.reshape(-1)[order], w, 0.0)
        out = torch.zeros(t, shape[-1], device=x.device).index_add_(0, token, ys * w[:, None])
        if self.shared is not None:
            out = out + self.shared(flat).float()
        if self.training and torch.is_grad_enabled():
            dropped = (t * k - counts[:e].sum()).float() if keep is not None else 0.0
            self._count(logits, scores, experts, shape, dropped)
        return out.to(x.dtype).view(shape)

    def _count(self, logits, scores, experts, shape, dropped) -> None:
        """Set ``aux_loss`` (the weighted losses) and add this micro-batch to the step's counters. A
        recomputation (activation checkpointing) builds the same loss graph, as checkpointing requires
        the same saved tensors, but neither sets ``aux_loss`` again nor counts."""
        probs = score_distribution(scores, self.score)
        values = {
            "aux_loss": lambda: switch_aux_loss(probs, experts, self.n_experts),
            "seq_aux_loss": lambda: sequence_aux_loss(
                probs.view(*shape[:-1], -1), experts.view(*shape[:-1], -1), self.n_experts
            ),
            "z_loss": lambda: router_z_loss(logits),
        }
        raw = {n: values[n]() if c else None for n, c in self.coefficients.items()}
        terms = [self.coefficients[n] * v for n, v in raw.items() if v is not None]
        if _recomputing():
            return
        self.aux_loss = torch.stack(terms).sum() if terms else None
        with torch.no_grad():
            self.load += expert_counts(experts, self.n_experts)
            zero = torch.zeros((), device=logits.device)
            entries = [raw[n].detach() if raw[n] is not None else zero for n in LOSSES]
            entries += [router_entropy(probs), zero + dropped, zero + 1]
            self.sums += torch.stack(entries)


# -- the model's MoE layers, as the training module and the optimizer hook see them ----------------------


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoE]]:
    """``(block index, layer)`` of every MoE layer of ``model`` (a layer on its own: ``("0", layer)``)."""
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            found = re.search(r"blocks\.(\d+)", name)
            yield found.group(1) if found else "0", module


def expert_params(model: nn.Module) -> Iterator[nn.Parameter]:
    """The routed experts' weights of every MoE layer of ``model`` (what expert parallelism shards)."""
    for _, layer in moe_layers(model):
        yield from layer.experts.parameters()


def start_step(model: nn.Module) -> None:
    """A step's first micro-batch: restart every layer's counters (a vetoed step's are dropped)."""
    for _, layer in moe_layers(model):
        layer.load.zero_()
        layer.sums.zero_()


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum over MoE layers of the last forward's weighted balance losses (None: none is on)."""
    terms = []
    for _, layer in moe_layers(model):
        if layer.aux_loss is not None:
            terms.append(layer.aux_loss)
            layer.aux_loss = None
    return torch.stack(terms).sum() if terms else None


class _CarryAuxLoss(torch.autograd.Function):
    """``hidden`` unchanged in forward; in backward ``hidden``'s gradient passes through and ``aux`` gets
    the gradient 1, so one backward from a pipeline stage's output also differentiates ``aux``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


def carry_aux_loss(hidden: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``hidden`` with ``aux`` (a scalar graph tensor) riding on it: the value is ``hidden``'s, and a
    backward through it adds ``d aux / d theta`` to the gradients. Pipeline stages use it: the schedule
    runs backward from each stage's output (the next stage's input gradient), not from a loss that could
    include the balance losses of the stage's MoE layers."""
    return _CarryAuxLoss.apply(hidden, aux)


@torch.no_grad()
def after_optimizer_step(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """After each optimizer step: each layer's load summed over the data-parallel ``group`` (None: one
    data-parallel rank, nothing to sum; the tensor- and pipeline-parallel ranks of a data-parallel rank
    route the same tokens, or hold other layers) and, with ``bias_update_rate``, its bias moved by
    :func:`update_bias` (the same on every rank)."""
    for _, layer in moe_layers(model):
        if group is not None:
            dist.all_reduce(layer.load, group=group)
        if layer.bias_rate:
            update_bias(layer.expert_bias, layer.load, layer.bias_rate)


def register_balance_step(optimizer: torch.optim.Optimizer, model: nn.Module, group=None) -> bool:
    """Run :func:`after_optimizer_step` after every step ``optimizer`` takes (a post-step hook: a step the
    loss scaler or the guard skips never runs it). False (nothing registered) without MoE layers."""
    if not any(True for _ in moe_layers(model)):
        return False
    optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: after_optimizer_step(model, group))
    return True


def layer_records(model: nn.Module) -> list[tuple[str, list[float], list[float], dict[str, float]]]:
    """``(block index, load, sums, coefficients)`` of every MoE layer of ``model``: what
    :func:`moe_metrics` reads, as plain values that can be gathered from other ranks."""
    return [
        (index, layer.load.tolist(), layer.sums.tolist(), dict(layer.coefficients))
        for index, layer in moe_layers(model)
    ]


@torch.no_grad()
def moe_metrics(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float | list[float]]:
    """The last step's figures per MoE layer ``i``: ``moe/layer.<i>/load`` (tokens routed to each expert,
    all data-parallel ranks), ``/imbalance`` (max / mean load), ``/dropped`` (assignments over capacity),
    ``/entropy`` (router entropy, mean over micro-batches); over the layers: ``moe/imbalance`` (the
    largest), and each balance loss that is on, raw (no coefficient), mean over layers and micro-batches.
    ``group``: the pipeline group, whose ranks hold other layers (their records are gathered, a
    collective every rank of it calls); None: this rank's layers are all of them."""
    records = layer_records(model)
    if group is not None:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, records, group=group)
        records = sorted((r for part in gathered for r in part), key=lambda r: int(r[0]))
    out: dict[str, float | list[float]] = {}
    losses = {n: [] for n in LOSSES}
    worst = 0.0
    for index, load, sums, coefficients in records:
        n = max(sums[5], 1.0)
        ratio = float(imbalance(torch.tensor(load, dtype=torch.float64)))
        worst = max(worst, ratio)
        out[f"moe/layer.{index}/load"] = [round(v, 3) for v in load]
        out[f"moe/layer.{index}/imbalance"] = ratio
        out[f"moe/layer.{index}/dropped"] = sums[4]
        out[f"moe/layer.{index}/entropy"] = sums[3] / n
        for i, name in enumerate(LOSSES):
            if coefficients[name]:
                losses[name].append(sums[i] / n)
    if out:
        out["moe/imbalance"] = worst
    out.update({f"moe/{n}": sum(v) / len(v) for n, v in losses.items() if v})
    return out
