"""Mixture of experts: a block's MLP replaced by routed SwiGLU experts (``model.moe``, docs/moe.md).

The layer is composed of parts that each do one job:

* the **router**, ``self.router``: an ordinary ``nn.Linear(d_model, experts)`` called through its own
  forward (``moe_routing.py::router_logits``), so every feature that replaces linear layers (LoRA,
  QLoRA, QAT; ``model/wrap.py`` lists what each may wrap) reaches it like any other layer;
* **routing, dispatch and combine** (``model/moe_routing.py``, pure functions): token-choice top-k over
  the scores ``softmax(z)`` or ``sigmoid(z)`` with the balancing bias choosing only, the capacity, the
  rows sorted by expert for the experts and their weighted outputs added back per token. The token's
  output is ``sum_chosen g_e SwiGLU_e(x) (+ the shared experts' SwiGLU(x))``;
* the **experts** (``model/moe_experts.py::GroupedExperts``): 3-D weights and grouped matrix products;
  under expert parallelism (``parallel.ep``) the rows go to the experts' ranks and back through the
  layer's ``exchange`` (``parallel/expert.py::ExpertExchange``, set from outside);
* the **balance rules** (``model/moe_balance.py``, pure functions) and the counters below.

Under tensor parallelism the router and the routed experts are replicated over the TP ranks and the
layer gets the whole gathered input (``parallel/tensor.py::_moe_plan``). The recipe's checks (``ep``,
capacity, what does not combine with MoE) live beside the config: ``config.py::check_moe``.

Capacity (``capacity_factor > 0``, training only: evaluation and generation are dropless): each expert
takes at most ``C = floor(factor * T * k / E)`` assignments of a micro-batch, in priority order: every
token's first choice before any second choice, then by token position; the rest are dropped (the token
keeps its other experts and the residual), counted, and not computed (``moe_routing.py::dispatch``).

Routing, the combination and the balance losses compute in FP32, or FP64 for a float64 model, whatever
the input's dtype; the experts compute in the input's (or autocast's) dtype. The balance losses are
averaged over the step's micro-batches by the training module and added to the loss; a pipeline stage
carries its layers' losses on its output (:func:`carry_aux_loss`); auxiliary-loss-free balancing runs
after each optimizer step (:func:`register_balance_step`).

What each MoE layer counts during a training step (non-persistent buffers, restarted by
:func:`start_step` at a step's first micro-batch, read by :func:`moe_metrics`): tokens routed to each
expert, dropped assignments, router entropy and the raw balance losses. A forward recomputed by
activation checkpointing in backward counts nothing twice.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.moe_balance import (
    imbalance,
    router_entropy,
    router_z_loss,
    sequence_aux_loss,
    switch_aux_loss,
    update_bias,
)
from lmforge.model.moe_experts import GroupedExperts
from lmforge.model.moe_routing import (
    accumulation_dtype,
    combine,
    dispatch,
    expert_capacity,
    expert_counts,
    route,
    router_logits,
    router_scores,
    score_distribution,
)

LOSSES = ("aux_loss", "seq_aux_loss", "z_loss")  # the order of MoE.sums' first entries


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
        acc = accumulation_dtype(x.dtype)
        logits = router_logits(self.router, flat)
        scores = router_scores(logits, self.score)
        experts, weights = route(scores, k, self.normalize, self.expert_bias if self.bias_rate else None)
        capacity = expert_capacity(t, k, e, self.capacity_factor if self.training else 0.0)
        d = dispatch(experts, weights, e, capacity)
        rows = flat[d.token]
        if self.exchange is None:
            ys = self.experts(rows, d.counts[:e], self.kernel)
        else:
            ys = self.exchange(self.experts, rows, d.counts, self.kernel)
        out = combine(ys.to(acc), d, t)
        if self.shared is not None:
            out = out + self.shared(flat).to(acc)
        if self.training and torch.is_grad_enabled():
            self._count(logits, scores, experts, shape, d.dropped)
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
            entries = [raw[n].detach().float() if raw[n] is not None else zero for n in LOSSES]
            entries += [router_entropy(probs).float(), zero + dropped, zero + 1]
            self.sums += torch.stack(entries).to(self.sums.dtype)


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
