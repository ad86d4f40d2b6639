"""Gradient transforms between clipping and the optimizer step: gradient noise and gradient centralization.

The step (``train/step.py``) measures the gradient norm, clips, then calls :meth:`GradTransforms.apply`
on the clipped gradients, then steps the optimizer. In that order:

* **Gradient noise** (Neelakantan et al. 2015, "Adding Gradient Noise Improves Learning for Very Deep
  Networks", arXiv 1511.06807): every gradient gets ``g <- g + N(0, sigma_t^2)`` element-wise, with
  ``sigma_t^2 = eta / (1 + t)^gamma`` (``optim.grad_noise.eta``, ``optim.grad_noise.gamma``; the paper
  takes eta from {0.01, 0.3, 1.0} and gamma = 0.55) and ``t`` the number of optimizer steps taken before
  this one (0 at the first). Added *after* clipping: noise of variance eta on each of N values has norm
  ``sqrt(N eta)`` (100 for a million values at eta = 0.01), so clipping after it would mostly shrink the
  loss gradient, and the norm the guard and the metrics see stays the loss gradient's own.
  The noise of parameter ``name`` at step ``t`` comes from a generator seeded with a hash of
  ``(train.seed, t, name)`` drawing the whole tensor: the same values in every layout (a DTensor shard
  keeps its part of the whole draw), on every data-parallel replica (DDP's replicas stay equal) and after
  a resume (the state is ``t``, in the checkpoint). A tied copy (a pipeline's output head holding the
  embedding) draws under its original's name, so the two stay equal.
* **Gradient centralization** (Yong et al. 2020, "Gradient Centralization: A New Optimization Technique
  for Deep Neural Networks", ECCV, arXiv 2004.01461): for a fully connected weight the paper writes
  ``W in R^{M x N}`` with one column ``w_i`` per output neuron and ``M`` its inputs, and sets
  ``grad_{w_i} <- grad_{w_i} - mean_j(grad_{w_ij})``: each output unit's gradient loses its mean over the
  unit's inputs. torch's ``nn.Linear`` stores ``[out, in]``, so it is each row's mean over the last
  dimension: ``g <- g - g.mean(dim=1, keepdim=True)``. Applied to 2-D ``matrix`` parameters (attention,
  MLP, router, an untied head), not to embeddings (a lookup table, not a map over input features: the
  paper's layers are convolutions and fully connected ones), norms, biases, or the 3-D expert tensors.
  With both on, the noise is added first: the noisy gradient is what the centralized optimizer sees.
  "Inside AdamW" (the paper's Adam/AdamW variants centralize the gradient first thing in their step,
  before the moments) is this same computation: AdamW's decay is decoupled, so nothing else enters the
  gradient it sees. Under ``adam`` and ``sgd`` torch adds the L2 term ``wd * p`` inside the step, after
  this transform: the loss gradient is centralized, not the L2 term.
  Under FSDP2 a gradient is a DTensor sharded on dim 0 (rows): every row is whole on its rank and the
  mean is local. Tensor parallelism's row-wise layers shard dim 1: the mean is computed with DTensor ops,
  which sum the row's parts over the ranks (correct, one small all-reduce per such matrix).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def noise_std(eta: float, gamma: float, t: int) -> float:
    """``sigma_t = sqrt(eta / (1 + t)^gamma)``: the noise's standard deviation at step ``t`` (0-based)."""
    return math.sqrt(eta / (1.0 + t) ** gamma)


def noise_seed(seed: int, t: int, name: str) -> int:
    """The generator seed of parameter ``name``'s noise at step ``t``: a stable 63-bit hash."""
    digest = hashlib.blake2b(f"{seed}/{t}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_noise(grad: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """``N(0, std^2)`` shaped as ``grad``'s whole tensor, drawn on its device from ``seed``; for a DTensor,
    this rank's part of that whole draw (same placements)."""
    gen = torch.Generator(device=grad.device).manual_seed(seed)
    whole = torch.randn(grad.shape, generator=gen, device=grad.device, dtype=grad.dtype) * std
    if isinstance(grad, DTensor):
        return distribute_tensor(whole, grad.device_mesh, grad.placements, src_data_rank=None)
    return whole


def centralize_(grad: torch.Tensor) -> torch.Tensor:
    """``g_ij <- g_ij - (1/n) sum_k g_ik`` for a 2-D gradient ``[out, in]`` (each row's mean over its inputs),
    in place; DTensors through DTensor ops (a row sharded over ranks is summed over them)."""
    grad.sub_(grad.mean(dim=1, keepdim=True))
    return grad


class GradTransforms:
    """Gradient noise and centralization as configured (formulas in the module docstring).

    ``names``: parameter id -> the name its noise is drawn under; ``centralized``: ids of the parameters
    to centralize. State (:meth:`state_dict`): ``t``, the steps transformed so far.
    """

    def __init__(
        self,
        names: dict[int, str],
        centralized: frozenset[int] = frozenset(),
        eta: float = 0.0,
        gamma: float = 0.55,
        seed: int = 0,
    ):
        self.names, self.centralized = names, centralized
        self.eta, self.gamma, self.seed = eta, gamma, seed
        self.t = 0

    @classmethod
    def for_model(
        cls, model: nn.Module, centralize: bool, eta: float, gamma: float, seed: int
    ) -> GradTransforms:
        """The transforms of ``model``'s parameters: noise names (tied copies under their original's),
        and with ``centralize`` the 2-D weights that are neither embeddings nor norms."""
        copies = model.tied_copies() if hasattr(model, "tied_copies") else {}
        names = {id(p): copies.get(n, n) for n, p in model.named_parameters()}
        centralized: set[int] = set()
        if centralize:
            skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
            skip |= {id(p) for n, p in model.named_parameters() if n in copies}  # a copy of an embedding
            centralized = {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in skip}
        return cls(names, frozenset(centralized), eta, gamma, seed)

    @property
    def active(self) -> bool:
        return self.eta > 0 or bool(self.centralized)

    def apply(self, groups: Sequence[Iterable[torch.Tensor]]) -> None:
        """Transform the (clipped) gradients of ``groups`` in place, then count the step."""
        if not self.active:
            return
        std = noise_std(self.eta, self.gamma, self.t)
        with torch.no_grad():
            for p in (p for group in groups for p in group):
                if p.grad is None:
                    continue
                if self.eta > 0:
                    p.grad.add_(draw_noise(p.grad, std, noise_seed(self.seed, self.t, self.names[id(p)])))
                if id(p) in self.centralized:
                    centralize_(p.grad)
        self.t += 1

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state.get("t", 0))
