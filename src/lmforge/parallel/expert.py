"""Expert parallelism (``parallel.ep``): each MoE layer's routed experts split among ``ep`` ranks, and every
token's rows sent to the rank of the expert that computes them by all-to-all.

The mesh. The ``dp = dp_replicate * dp_shard`` data-parallel ranks of a run (each reading other sequences)
are also arranged as ``(edp, ep)`` with ``edp = dp / ep`` (``Layout.ep_mesh``, ranks in the same row-major
order as the data-parallel mesh): the ``ep`` ranks of a row hold different experts, the ``edp`` ranks of
a column hold the same ones.

The parameters. The experts' 3-D weights ``[experts, d_in, d_out]`` become DTensors sharded on dim 0 over
``ep`` (``Shard(0)``): a rank holds ``experts / ep`` whole experts of every MoE layer. They are left out of
DDP and FSDP2 (the dense parts keep their data parallelism), so they are replicated over ``edp``. Being
DTensors, they are checkpointed by DCP under their whole shape, so a run resumes with another ``ep`` (or
in one process), and the gradient norm counts each expert once.

A layer's forward (:class:`ExpertExchange`, called by ``model/moe.py::MoE`` with the rows it routed,
sorted by expert, and the rows per expert):

1. all-to-all of the per-expert row counts (``E`` integers): each rank learns how many rows every
   source rank sends to each of its experts;
2. all-to-all of the rows (``all_to_all_single`` with uneven splits; works on gloo and NCCL): a rank
   receives, source by source, the rows for its experts;
3. the received rows are regrouped by local expert (a stable sort), run through the local experts'
   grouped matrix products, put back in arrival order;
4. all-to-all back, with the splits reversed: every row returns to the rank of its token.

Backward runs the two row exchanges in reverse (:class:`AllToAll`). The routing itself (scores, top-k,
capacity, balance losses) is computed by each rank on its own tokens, as under plain data parallelism.

Gradients. Each rank's loss is multiplied by ``dp`` (``train/step.py``), and the rows exchange carries
every source rank's contribution into the expert's rank, so after backward an expert's gradient on a
rank is the sum over its ``ep`` group. :meth:`ExpertGradSync.finish` sums it over ``edp`` and divides by
``dp``: the one-process gradient of the step's mean loss, as DDP and FSDP2 give the dense parameters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lmforge.model.moe import expert_params, moe_layers
from lmforge.model.moe_experts import GroupedExperts


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of the rows of ``x`` (``send[i]`` rows to rank ``i`` of ``group``, ``recv[i]``
    rows from it); backward sends the gradient back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertExchange:
    """How an MoE layer runs its experts under expert parallelism (see the module docstring): called with
    the experts module, the routed rows sorted by expert, the rows per expert (``E + 1`` entries: the last
    counts dropped rows, which sit at the end and get zeros) and the kernel; returns each row's output."""

    def __init__(self, ep: int, group: dist.ProcessGroup):
        self.ep, self.group = ep, group

    @torch.compiler.disable  # collectives with host-side splits: outside any compiled graph
    def __call__(
        self, experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor, kernel: str
    ) -> torch.Tensor:
        n_experts = counts.numel() - 1
        local = n_experts // self.ep
        sent = counts[:n_experts]
        kept = rows.shape[0] - int(counts[n_experts])
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent.contiguous(), group=self.group)
        send = sent.view(self.ep, local).sum(1).tolist()
        recv = got.view(self.ep, local).sum(1).tolist()
        arrived = AllToAll.apply(rows[:kept], send, recv, self.group)
        # arrival order: by source rank, then by local expert; regroup by local expert
        expert_of_row = torch.arange(local, device=rows.device).repeat(self.ep).repeat_interleave(got)
        order = expert_of_row.argsort(stable=True)
        out = experts(arrived[order], got.view(self.ep, local).sum(0), kernel)
        out = out.index_select(0, order.argsort())
        back = AllToAll.apply(out, recv, send, self.group)
        if kept < rows.shape[0]:
            back = torch.cat([back, back.new_zeros(rows.shape[0] - kept, back.shape[1])])
        return back


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts on dim 0 over ``ep_mesh["ep"]`` (the model may still be on the meta
    device: nothing is sent) and give the layer its :class:`ExpertExchange`. Under tensor parallelism
    (``tp > 1``; the experts arrive replicated over it, ``parallel/tensor.py``) they live on the 2-D
    ``(ep, tp)`` mesh as ``[Shard(0), Replicate()]``: every TP rank of an expert group holds the same
    experts and sends the same rows (each TP rank routes every token of its data-parallel rank)."""
    tp = ep_mesh["tp"].size()
    mesh, placements = (
        (ep_mesh["ep", "tp"], [Shard(0), Replicate()]) if tp > 1 else (ep_mesh["ep"], [Shard(0)])
    )
    for _, layer in moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            whole = param.data.to_local() if isinstance(param.data, DTensor) else param.data
            sharded = distribute_tensor(whole, mesh, placements, src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        group = ep_mesh["ep"]
        layer.exchange = ExpertExchange(group.size(), group.get_group())


class ExpertGradSync:
    """After a step's last backward: each expert gradient summed over the ``edp`` ranks holding the same
    experts and divided by ``dp`` (see the module docstring)."""

    def __init__(self, model: nn.Module, ep_mesh: DeviceMesh, dp: int):
        self.model = model
        self.group = ep_mesh["edp"].get_group() if ep_mesh["edp"].size() > 1 else None
        self.dp = dp

    @torch.no_grad()
    def finish(self) -> None:
        for p in expert_params(self.model):
            if p.grad is None:  # no row reached this rank's experts in the whole step
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.group is not None:
                dist.all_reduce(local, group=self.group)
            local.div_(self.dp)
