"""Initialisation schemes: the standard (GPT-2) parametrisation and muP.

Standard (GPT-2): every linear and embedding weight ~ N(0, std^2); the projections that write into the
residual stream (``o_proj``, ``down_proj``, ``fc_out``) ~ N(0, (std / sqrt(2 * n_layers))^2), so the
residual variance stays O(1) over depth; biases 0; norm weights 1.

muP, the maximal-update parametrisation (G. Yang, E. Hu et al., "Tensor Programs V: Tuning Large Neural
Networks via Zero-Shot Hyperparameter Transfer", 2022, arXiv:2203.03466; Adam rules of its Tables 3 and
8, written relative to a base shape). With ``m = d_model / mup_base_width`` (the width multiplier):

* input weights (token and position embeddings): init std ``std``, Adam learning rate ``x 1``;
* hidden weights (every matrix inside a block, fan-in and fan-out both growing with width): init std
  ``std / sqrt(m)`` (variance proportional to 1 / fan_in; residual outputs keep their extra
  ``1 / sqrt(2 n_layers)``), Adam learning rate ``x 1 / m``;
* output weights: logits ``= (W_out h) / m``, init std ``std``, Adam learning rate ``x 1``;
* attention logits: ``q . k * sqrt(d_head_base) / d_head`` with ``d_head_base = mup_base_width / n_heads``
  (1 / d_head instead of 1 / sqrt(d_head): q and k become correlated during training, so their dot
  product grows like d_head, not sqrt(d_head));
* norm weights and biases: unchanged (init 1 / 0, learning rate ``x 1``).

At ``m = 1`` every rule is the standard parametrisation, so hyperparameters tuned at the base width carry
over to wider models. Widths are meant to grow at a fixed number of heads (``d_head`` grows with
``d_model``), and the MLP width in proportion to ``d_model`` (the default ``d_ff`` does).

Tied embeddings: the shared matrix is both the input and the output weight. In this formulation both roles
want init std ``std`` and an unscaled Adam learning rate, so sharing stays consistent; the output role
gets its ``1 / m`` from the logit multiplier, not from the weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.model.moe_experts import GroupedExperts

RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "fc_out")
OUTPUT_HEAD = "lm_head"


def residual_std(std: float, n_layers: int) -> float:
    """``std / sqrt(2 * n_layers)``: two residual writes (attention, MLP) per block."""
    return std / math.sqrt(2 * n_layers)


def width_mult(d_model: int, base_width: int, mup: bool) -> float:
    """muP width multiplier ``m = d_model / base_width`` (1 without muP)."""
    return d_model / base_width if mup else 1.0


def hidden_std(std: float, m: float) -> float:
    """muP init std of a hidden matrix: ``std / sqrt(m)`` (variance proportional to 1 / fan_in)."""
    return std / math.sqrt(m)


def hidden_lr_scale(m: float) -> float:
    """muP Adam learning-rate multiplier of a hidden matrix: ``1 / m``."""
    return 1.0 / m


def logit_scale(m: float) -> float:
    """muP output multiplier: ``logits = (W_out h) / m``."""
    return 1.0 / m


def attention_scale(head_dim: int, base_head_dim: int, mup: bool) -> float | None:
    """Softmax scale of ``q . k``: ``sqrt(base_head_dim) / head_dim`` under muP, else None (the kernel's
    default ``1 / sqrt(head_dim)``); the two agree at ``head_dim = base_head_dim``."""
    return math.sqrt(base_head_dim) / head_dim if mup else None


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A matrix inside a block (``blocks.<i>.``...): the weights muP treats as hidden."""
    return p.ndim >= 2 and (name.startswith("blocks.") or ".blocks." in name)


@dataclass(frozen=True)
class InitStep:
    """One parameter's initialisation: ``kind`` (``normal``: ~ N(0, std^2) drawn from the global RNG;
    ``zeros``; ``ones``) applied to the tensor known by ``names`` (several names: one tensor shared by
    them, e.g. a tied embedding and output head)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    std: float = 0.0

    @property
    def draws(self) -> bool:
        """Whether this step consumes random numbers (the order of such steps is the random stream)."""
        return self.kind == "normal"

    @torch.no_grad()
    def apply(self, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (the whole parameter) in place. A float64 tensor (``train.precision = "fp64"``)
        gets the FP32 draws widened, so that a float64 verification run starts from the values of the FP32
        run with the same seed (float64 draws would be other numbers)."""
        if self.kind == "normal" and tensor.dtype == torch.float64:
            tensor.copy_(nn.init.normal_(torch.empty_like(tensor, dtype=torch.float32), 0.0, self.std))
        elif self.kind == "normal":
            nn.init.normal_(tensor, 0.0, self.std)
        elif self.kind == "zeros":
            nn.init.zeros_(tensor)
        else:
            nn.init.ones_(tensor)


def init_plan(model: nn.Module, std: float, n_layers: int, m: float = 1.0) -> list[InitStep]:
    """The initialisation of every parameter of ``model``, in the order it is applied (module order, so
    the random draws of a model are always taken in the same sequence). Standard init for ``m = 1``; with a
    muP width multiplier ``m``, hidden matrices get ``std / sqrt(m)`` (the output head and embeddings keep
    ``std``). See the module docstring. A parameter shared by several modules (tied embeddings) is
    initialised once, by its first owner in module order, under every name it has.

    The plan needs only the parameters' names and shapes, so it is computed on a meta-device model: a
    sharded build (``lmforge/parallel/materialize.py``) walks the whole model's plan, draws each whole
    parameter and keeps its own part, and so gets exactly the values of :func:`init_weights`.
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    plan: list[InitStep] = []
    done: set[int] = set()

    def add(module_name: str, param: torch.Tensor | None, kind: str, s: float = 0.0) -> None:
        if param is None or id(param) in done:
            return
        done.add(id(param))
        plan.append(InitStep(tuple(names[id(param)]), tuple(param.shape), param.dtype, kind, s))

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            short = name.rsplit(".", 1)[-1]
            s = residual_std(std, n_layers) if short in RESIDUAL_OUTPUTS else std
            if short != OUTPUT_HEAD:
                s = hidden_std(s, m)
            add(name, module.weight, "normal", s)
            add(name, module.bias, "zeros")
        elif isinstance(module, GroupedExperts):  # 3-D [experts, d_in, d_out]: as the dense MLP's
            for short in ("gate_proj", "up_proj", "down_proj"):
                s = residual_std(std, n_layers) if short in RESIDUAL_OUTPUTS else std
                add(name, getattr(module, short), "normal", hidden_std(s, m))
        elif isinstance(module, nn.Embedding):
            add(name, module.weight, "normal", std)
        elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
            add(name, module.weight, "ones")
            add(name, getattr(module, "bias", None), "zeros")
    return plan


@torch.no_grad()
def init_weights(model: nn.Module, std: float, n_layers: int, m: float = 1.0) -> None:
    """Initialise every parameter of ``model`` (materialised, whole) by :func:`init_plan`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for step in init_plan(model, std, n_layers, m):
        step.apply(params[step.names[0]])


def mup_lr_scales(model: nn.Module, m: float) -> dict[str, float]:
    """Learning-rate multiplier per parameter name under muP: ``1 / m`` for hidden matrices (see
    :func:`is_hidden_matrix`), nothing listed (1) for the rest. Empty when ``m == 1``."""
    if m == 1.0:
        return {}
    return {n: hidden_lr_scale(m) for n, p in model.named_parameters() if is_hidden_matrix(n, p)}
