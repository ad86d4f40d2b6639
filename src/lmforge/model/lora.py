"""LoRA and QLoRA adapters on the plain model's linear layers.

LoRA (E. Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021, arXiv:2106.09685): a
target layer ``y = W x + b`` becomes

    y = W x + b + (alpha / r) * B (A dropout(x)),    A: [r, d_in],  B: [d_out, r]

with ``W`` and ``b`` frozen and only ``A`` and ``B`` trained. ``A ~ N(0, 1 / d_in)`` (Kaiming normal,
gain 1) and ``B = 0``, so the adapted model starts equal to the base. Merging for export:
``W' = W + (alpha / r) B A``.

QLoRA (T. Dettmers et al., 2023, arXiv:2305.14314): the frozen ``W`` of each target layer is kept in
torchao's 4-bit NormalFloat (``torchao.quantization.to_nf4``: blocks of 64 values with one absmax scale
each, the scales themselves quantised to 8 bits in blocks of 256), dequantised to the input's dtype
inside each forward; the adapters stay in full precision. A weight whose element count is not a
multiple of 64 x 256 stays in full precision (torchao's block sizes).

The adapters are attached from outside (``parallel/apply.py``'s ``lora`` stage, :func:`apply_lora`): a
target ``nn.Linear`` is replaced by a :class:`LoRALinear` around its own ``weight`` / ``bias``
(``model/wrap.py``, which also says which layers LoRA may wrap), so
the base's checkpoint keys and export maps are unchanged; the adapters are ``<layer>.lora_A`` and
``<layer>.lora_B``. A quantised layer holds its NF4 weight as five plain buffers
``<layer>.weight_nf4.<part>`` (checkpointed as any tensor) and loads a full-precision ``<layer>.weight``
by quantising it.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn
from torch.nn import functional as F

from lmforge.config import LoraConfig
from lmforge.model.init import InitStep
from lmforge.model.wrap import linear_targets, replace, trained_heads

log = logging.getLogger(__name__)

ADAPTERS = ("lora_A", "lora_B")
NF4_PARTS = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
ALL_LINEAR = "all-linear"


def target_names(model: nn.Module, targets: str) -> list[str]:
    """Names of the linear layers of ``model`` that ``targets`` (``lora.targets``) selects among those LoRA
    may wrap (``model/wrap.py``: not the output head, not a head the objective trains in full): each
    comma-separated pattern matches a layer whose name ends with ``.pattern`` (or equals it);
    ``all-linear``: every one of them (an MoE layer's router included)."""
    patterns = [t.strip() for t in targets.split(",") if t.strip()]

    def chosen(name: str, _layer: nn.Linear) -> bool:
        return ALL_LINEAR in patterns or any(name == p or name.endswith("." + p) for p in patterns)

    return linear_targets(model, "lora", chosen)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter (see the module docstring for the formula). Made from an
    existing layer by :meth:`attach` (in place: same module object, same ``weight`` / ``bias``)."""

    rank: int
    scale: float
    nf4_meta: dict | None

    @classmethod
    def around(cls, layer: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRA layer holding ``layer``'s own ``weight`` and ``bias`` (the same parameters) and new
        adapters (:meth:`attach`); ``layer`` itself is left as it was."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight = layer.weight
        new.register_parameter("bias", layer.bias)
        new.attach(rank, alpha, dropout)
        return new

    def attach(self, rank: int, alpha: float, dropout: float) -> None:
        """Add ``lora_A`` [rank, d_in] and ``lora_B`` [d_out, rank] on the weight's device (meta: values come
        from :func:`adapter_plan`)."""
        self.rank, self.scale, self.nf4_meta = rank, alpha / rank, None
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        like = dict(device=self.weight.device, dtype=self.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **like))

    def base_weight(self) -> torch.Tensor:
        """The frozen weight: the parameter, or (QLoRA) the NF4 tensor over this layer's buffers."""
        if self.nf4_meta is None:
            return self.weight
        from torchao.quantization import NF4Tensor

        parts = {p: getattr(self, "weight_nf4_" + p) for p in NF4_PARTS}
        shape = self.nf4_meta["tensor_meta"].original_shape
        return NF4Tensor.__tensor_unflatten__(parts, self.nf4_meta, shape, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nf4_meta is None:
            y = F.linear(x, self.weight, self.bias)
        else:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            y = linear_nf4(x, self.base_weight())
            y = y + self.bias if self.bias is not None else y
        return y + self.scale * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    def delta(self) -> torch.Tensor:
        """``(alpha / r) B A``: what merging adds to the weight."""
        return self.scale * (self.lora_B @ self.lora_A)

    @torch.no_grad()
    def quantize(self) -> bool:
        """QLoRA: replace the (materialised) frozen weight by its NF4 form held in buffers; False (and left
        in full precision) where the weight's size does not fit torchao's blocks."""
        if self.weight.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK):
            return False
        from torchao.quantization import to_nf4

        nf4 = to_nf4(self.weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
        names, meta = nf4.__tensor_flatten__()
        del self.weight
        self.register_parameter("weight", None)
        for name in names:
            self.register_buffer("weight_nf4_" + name, getattr(nf4, name))
        self.nf4_meta = meta
        return True

    def _load_from_state_dict(self, state, prefix, local_metadata, strict, missing, unexpected, errors):
        """A quantised layer given a full-precision ``weight`` (a base checkpoint) quantises it into its
        buffers; everything else loads as usual."""
        full = state.get(prefix + "weight") if self.nf4_meta is not None else None
        super()._load_from_state_dict(state, prefix, local_metadata, strict, missing, unexpected, errors)
        if full is None:
            return
        self.base_weight().copy_(full.to(self.lora_A.device))  # NF4's copy_ of a dense tensor quantises
        parts = {prefix + "weight_nf4_" + p for p in NF4_PARTS}
        missing[:] = [k for k in missing if k not in parts]
        unexpected[:] = [k for k in unexpected if k != prefix + "weight"]


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Adapters on the target layers of ``model`` (``lora.targets``; each layer replaced by a
    :class:`LoRALinear` around its own parameters, ``model/wrap.py::replace``) and every other parameter
    frozen (``requires_grad = False``) but those of the heads the model trains in full
    (``model/wrap.py::trained_heads``: a reward model's score, PPO's value head); returns the adapted
    layers' names. On a meta model nothing is allocated."""
    names = target_names(model, cfg.targets)
    for name in names:
        replace(model, name, lambda layer: LoRALinear.around(layer, cfg.rank, cfg.alpha, cfg.dropout))
    heads = tuple(h + "." for h in trained_heads(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTERS or name.startswith(heads))
    return names


def adapter_plan(model: nn.Module) -> list[InitStep]:
    """The adapters' initialisation (``model/init.py``'s steps), in module order: ``A ~ N(0, 1 / d_in)``,
    ``B = 0``. Drawn after the whole base model's plan, so the base gets the values it has without LoRA and
    the adapters follow from the same ``train.seed``."""
    plan = []
    for name, layer in lora_layers(model).items():
        a, b = layer.lora_A, layer.lora_B
        plan.append(
            InitStep((f"{name}.lora_A",), tuple(a.shape), a.dtype, "normal", 1 / math.sqrt(a.shape[1]))
        )
        plan.append(InitStep((f"{name}.lora_B",), tuple(b.shape), b.dtype, "zeros"))
    return plan


def quantize_base(model: nn.Module) -> list[str]:
    """QLoRA: the frozen weights of every adapted layer to NF4 (:meth:`LoRALinear.quantize`); returns the
    layers left in full precision (their size does not fit NF4's blocks)."""
    kept = [name for name, layer in lora_layers(model).items() if not layer.quantize()]
    if kept:
        log.info("lora.quantize: %d layers stay in full precision (size not a multiple of 16384)", len(kept))
    return kept


def _layer_of(key: str) -> str:
    return key.rsplit(".", 1)[0]


def dense_base(state: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """A LoRA model's state (checkpoint tensors by name) -> the base's tensors in full precision: the
    adapters dropped, an NF4 weight dequantised into ``<layer>.weight`` (FP32, of its shape in
    ``shapes``)."""
    out = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in ADAPTERS and "weight_nf4_" not in k}
    for layer in {_layer_of(k) for k in state if k.endswith(".weight_nf4_nf4")}:
        from torchao.quantization import to_nf4

        parts = {p: state[f"{layer}.weight_nf4_{p}"] for p in NF4_PARTS}
        n = parts["quantized_data"].numel() * 2  # two 4-bit codes a byte
        template = to_nf4(torch.zeros(n // NF4_BLOCK, NF4_BLOCK), NF4_BLOCK, NF4_SCALER_BLOCK)
        _, meta = template.__tensor_flatten__()
        whole = type(template).__tensor_unflatten__(parts, meta, template.shape, None)
        out[f"{layer}.weight"] = whole.get_original_weight().reshape(shapes[f"{layer}.weight"])
    return out


def merged_state(state: dict[str, torch.Tensor], cfg: LoraConfig, shapes: dict[str, tuple]) -> dict:
    """``W + (alpha / r) B A`` for every adapted layer of ``state``, adapters dropped: a plain model's
    state (``shapes``: the plain model's parameter shapes, for NF4 weights)."""
    out = dense_base(state, shapes)
    for key in [k for k in state if k.endswith(".lora_A")]:
        layer = _layer_of(key)
        a, b, w = state[key], state[f"{layer}.lora_B"], out[f"{layer}.weight"]
        out[f"{layer}.weight"] = (w.float() + (cfg.alpha / cfg.rank) * (b.float() @ a.float())).to(w.dtype)
    return out


def is_adapter_key(key: str) -> bool:
    """Whether a state key is an adapter's (``<layer>.lora_A`` / ``lora_B``)."""
    return re.search(r"\.lora_[AB]$", key) is not None
