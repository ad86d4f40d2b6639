"""Quantization-aware training: the blocks' linear layers fake-quantized in every forward (torchao).

A target layer ``y = W x + b`` computes ``y = Q_w(W) Q_a(x) + b`` in full precision, where ``Q`` rounds
to the integer grid the exported model will use and maps straight back (quantize-dequantize):

* weights, symmetric, ``b`` bits (4 or 8), one scale per row and group of ``g`` input columns
  (``qat.group_size``; 0: the whole row)::

      s     = max(max |W[i, group]| / ((2^b - 1) / 2), eps)
      Q_w(W) = clamp(round(W * (1 / s)), -2^(b-1), 2^(b-1) - 1) * s

* activations (schemes ``int8da-*``), asymmetric int8, one scale and zero point per token (row of the
  last dimension)::

      lo = min(min x, 0),  hi = max(max x, 0),  s = max((hi - lo) / 255, eps)
      z  = clamp(-128 - round(lo / s), -128, 127)
      Q_a(x) = (clamp(round(x * (1 / s)) + z, -128, 127) - z) * s

``round`` is half to even (``torch.round``) and ``eps`` the dtype's smallest normal number. The
product with the reciprocal ``1 / s`` (torchao's order, not ``W / s``) matters at one point: a group's
largest magnitude lands on the tie ``+-(2^b - 1) / 2`` and the reciprocal's rounding decides its side
(the positive tie is clamped to ``2^(b-1) - 1`` either way). Inputs must be float32, float16 or bfloat16
(torchao's kernels), so ``train.precision = "fp64"`` is refused. Backward
passes the gradient straight through the rounding (the straight-through estimator of torchao's
``_Round``) wherever the code lies inside the grid, and none where ``clamp`` cut it (in each weight
group, a value on the positive tie); the scale is not differentiated. The full-precision weights keep
training while the loss is that of the rounded model.
The arithmetic is torchao's (``torchao.quantization.qat.IntxFakeQuantizer`` with
``IntxFakeQuantizeConfig``), the same its post-training configs of :func:`ptq_config` apply on export.

The layers are transformed from outside (``parallel/apply.py``'s ``qat`` stage, :func:`apply_qat`): a
target ``nn.Linear`` is replaced by a :class:`QATLinear` around its own ``weight`` / ``bias`` (no new
parameters or buffers: checkpoints, optimizer state and export maps are those of the plain model). The
fake quantizers are switched on from ``qat.start_step`` on by :func:`set_fake_quant`, which the
training callback ``train/callbacks/control.py`` calls from the step count alone, so a resume restores it.
Targets: every ``nn.Linear`` of the model but the output head and the heads an objective trains
(``model/wrap.py``), an MoE layer's router included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lmforge.errors import ConfigError
from lmforge.model.wrap import linear_targets, replace


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: int8 dynamic activations or not, and the weights' bits."""

    activations: bool
    weight_bits: int


SCHEMES = {
    "int8da-int4w": Scheme(True, 4),
    "int4w": Scheme(False, 4),
    "int8da-int8w": Scheme(True, 8),
    "int8w": Scheme(False, 8),
}


def check_scheme(scheme: str, field: str = "qat.scheme") -> Scheme:
    """The scheme named ``scheme``; a user error listing the valid names if there is none."""
    if scheme not in SCHEMES:
        raise ConfigError(f"{field}: unknown scheme {scheme!r}; use one of {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


def target_names(model: nn.Module) -> list[str]:
    """The linear layers QAT and the export quantize: every ``nn.Linear`` QAT may wrap (``model/wrap.py``:
    not the output head, nor a head the objective trains, such as a reward model's score), an MoE
    layer's router included."""
    return linear_targets(model, "qat")


def check_group_size(model: nn.Module, group_size: int, field: str = "qat.group_size") -> None:
    """Every target layer's input width must be a multiple of ``group_size`` (0: per row, always fits)."""
    if group_size == 0:
        return
    modules = dict(model.named_modules())
    for name in target_names(model):
        width = modules[name].in_features
        if width % group_size:
            fits = [
                g
                for g in (256, 128, 64, 32, 16, 8)
                if all(modules[n].in_features % g == 0 for n in target_names(model))
            ]
            hint = f"e.g. {fits[0]}" if fits else "0 (one scale per row)"
            raise ConfigError(
                f"{field}: {group_size} does not divide the input width {width} of {name}; use a "
                f"divisor of every layer's input width, {hint}"
            )


def _granularity(group_size: int):
    from torchao.quantization.granularity import PerAxis, PerGroup

    return PerGroup(group_size) if group_size else PerAxis(0)


def fake_quant_configs(scheme: str, group_size: int) -> tuple:
    """(activation config or None, weight config) of torchao's ``IntxFakeQuantizeConfig`` for ``scheme``
    (the formulas of the module docstring)."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    s = check_scheme(scheme)
    weight = IntxFakeQuantizeConfig(
        torch.int4 if s.weight_bits == 4 else torch.int8, _granularity(group_size), is_symmetric=True
    )
    act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False) if s.activations else None
    return act, weight


def ptq_config(scheme: str, group_size: int):
    """torchao's post-training config that quantizes a linear layer as ``scheme`` fake-quantizes it:
    ``Int8DynamicActivationIntxWeightConfig`` or ``IntxWeightOnlyConfig`` (integer weights held as int8
    with their scales; CPU kernels)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig

    s = check_scheme(scheme, "--quantize")
    dtype = torch.int4 if s.weight_bits == 4 else torch.int8
    if s.activations:
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=dtype, weight_granularity=_granularity(group_size)
        )
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=_granularity(group_size))


class QATLinear(nn.Linear):
    """An ``nn.Linear`` that fake-quantizes its input and weight (module docstring), made around an
    existing layer's parameters by :meth:`around`."""

    @classmethod
    def around(cls, layer: nn.Linear, act_config, weight_config) -> QATLinear:
        """A fake-quantizing layer holding ``layer``'s own ``weight`` and ``bias`` (the same parameters)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = layer.in_features, layer.out_features
        new.weight = layer.weight
        new.register_parameter("bias", layer.bias)
        new.attach(act_config, weight_config)
        return new

    def attach(self, act_config, weight_config) -> None:
        """Add the fake quantizers (torchao ``IntxFakeQuantizer``; they hold no tensors that persist)."""
        from torchao.quantization.qat import IntxFakeQuantizer

        self.activation_fake_quant = IntxFakeQuantizer(act_config) if act_config is not None else None
        self.weight_fake_quant = IntxFakeQuantizer(weight_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_fake_quant is not None:
            x = self.activation_fake_quant(x)
        return F.linear(x, self.weight_fake_quant(self.weight), self.bias)


def qat_layers(model: nn.Module) -> dict[str, QATLinear]:
    """The fake-quantized layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}


def apply_qat(model: nn.Module, scheme: str, group_size: int) -> list[str]:
    """Replace every target layer of ``model`` (:func:`target_names`) by a :class:`QATLinear` of
    ``scheme`` around its parameters (``model/wrap.py::replace``); returns their names. Works on a meta model (nothing is allocated)."""
    check_group_size(model, group_size)
    act, weight = fake_quant_configs(scheme, group_size)
    names = target_names(model)
    for name in names:
        replace(model, name, lambda layer: QATLinear.around(layer, act, weight))
    return names


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch the fake quantization of every :class:`QATLinear` of ``model`` on or off (off: the plain
    full-precision layer)."""
    for layer in qat_layers(model).values():
        for fq in (layer.activation_fake_quant, layer.weight_fake_quant):
            if fq is not None:
                fq.enabled = enabled
