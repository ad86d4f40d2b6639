"""What each feature that replaces linear layers may wrap, and the one way it replaces them.

LoRA and QLoRA (``model/lora.py``), QAT (``model/qat.py``), FP8 (``precision.py``) and the export's
post-training quantization (``evaluate/quantized.py``) each replace ``nn.Linear`` layers of the model by
layers of their own. Two properties make "the layers a feature lists" the same as "the layers it
changes":

* **Every linear layer of the model is called through its module.** The model never reads a layer's
  ``weight`` for a product of its own: the attention and MLP projections, the MoE router
  (``model/moe_routing.py::router_logits``) and the shared experts are all ``layer(x)``. The exceptions
  are heads no feature lists: the output head ``lm_head``, whose weight the fused output head + loss
  (``model/fused_loss.py``) multiplies chunk by chunk, and the heads an objective trains in full (PPO's
  value head reads its local tensors under tensor parallelism). The MoE layer's
  routed experts are 3-D weights, not linear layers: no feature lists them (``tests/test_combinations.py``
  counts the calls of every listed layer and fails if one is never reached).
* **A layer is replaced, never mutated.** :func:`replace` builds the new layer around the old one's
  ``weight`` and ``bias`` parameters (the same tensors, so the parameter names, the initialisation plan,
  checkpoints and export maps are those of the plain model) and puts it where the old one was.

:data:`EXCLUDED` is the registry: per feature, the layers it never wraps. Heads an objective trains in
full beside LoRA's adapters are named by the model class itself (``trained_heads``: a reward model's
``score``, PPO's ``value_head``), so this module imports nothing of the objectives.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

OUTPUT_HEAD = "lm_head"

# feature -> the layer names (last part of the module path) it never wraps, beside the model's own
# trained_heads; why in each comment
EXCLUDED: dict[str, tuple[str, ...]] = {
    # the fused loss multiplies lm_head's weight itself; trained heads train in full, not through adapters
    "lora": (OUTPUT_HEAD,),
    # the export keeps the output head and the heads in full precision, so QAT does not fake-quantize them
    "qat": (OUTPUT_HEAD,),
    # the logits feed the loss in BF16 (precision.py::fp8_takes adds its shape rule)
    "fp8": (OUTPUT_HEAD,),
}


def trained_heads(model: nn.Module) -> tuple[str, ...]:
    """The heads ``model`` trains in full (its class's ``trained_heads``; none for a plain language model)."""
    return tuple(getattr(model, "trained_heads", ()))


def linear_targets(
    model: nn.Module, feature: str, select: Callable[[str, nn.Linear], bool] | None = None
) -> list[str]:
    """Names of the ``nn.Linear`` layers of ``model`` that ``feature`` (a key of :data:`EXCLUDED`) may
    wrap, in module order: every linear layer but those :data:`EXCLUDED` names and the model's
    :func:`trained_heads`; ``select(name, layer)`` narrows them (e.g. ``lora.targets``)."""
    skip = set(EXCLUDED[feature]) | set(trained_heads(model))
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.rsplit(".", 1)[-1] not in skip
        and (select is None or select(name, module))
    ]


def replace(model: nn.Module, name: str, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Put ``make(layer)`` in place of ``model``'s submodule ``name`` (a linear layer) and return it;
    ``make`` must keep the layer's ``weight`` and ``bias`` parameters (the same tensors)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    new = make(old)
    if new.weight is not old.weight or new.bias is not old.bias:
        raise RuntimeError(f"replacing {name}: the new layer must keep the old one's weight and bias")
    new.train(old.training)
    setattr(parent, child, new)
    return new
