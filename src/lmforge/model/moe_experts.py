"""The routed experts of an MoE layer: SwiGLU experts as 3-D weights and their grouped matrix products.

The experts' weights are parameters ``[experts, d_in, d_out]`` (``gate_proj``, ``up_proj``, ``down_proj``),
so expert parallelism can shard dim 0. The dispatched rows arrive sorted by expert
(``model/moe_routing.py::dispatch``) and each projection is one grouped matrix product over the groups
(``torch._grouped_mm``: CPU in FP32, BF16, FP16 with rows of a multiple of 16 bytes; torch 2.13), or a
loop of one matmul per expert where that kernel is missing (``train.moe_kernel``); both give the same
numbers (``tests/test_moe.py``). No wrapper of linear layers (LoRA, QAT, FP8) adapts these weights:
they are not ``nn.Linear`` layers, and ``model/wrap.py`` lists only those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


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
