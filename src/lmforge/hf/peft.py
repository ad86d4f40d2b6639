"""``lmforge export RUN --adapter``: a LoRA run as a PEFT adapter folder over its base.

PEFT (``peft.PeftModel.from_pretrained(base, folder)``) reads ``adapter_config.json`` and
``adapter_model.safetensors``. Each adapted layer's tensors are named as PEFT saves them:
``base_model.model.<Hugging Face module name>.lora_A.weight`` ([r, d_in]) and ``.lora_B.weight``
([d_out, r]); PEFT scales ``B A x`` by ``lora_alpha / r``, as lmforge does. The Hugging Face module name is
the one the architecture's export map gives the layer's weight by a plain rename (``renames(model)`` of
``llama.py``, ``mixtral.py``, ``qwen2_moe.py``, ``glm4_moe.py``), as ``transformers`` 5 names the module
it loads (Mixtral's ``block_sparse_moe.*`` tensors load as ``mlp.*``: ``mixtral.py::module_name``). A
layer the map reshapes rather than renames has no adapter form: a map without renames (GPT-2's fused,
transposed ``c_attn``) is refused whole, and an adapted layer without a renamed weight is refused by name
(drop it from ``lora.targets``, or export merged weights). A mixture of experts' routed experts are 3-D
parameters, not linear layers, so LoRA never adapts them; everything else there is a plain rename.

In the mixture-of-experts classes the adapted layers outside attention (a dense block's MLP, GLM's shared
experts, the router) are listed in ``target_parameters`` (PEFT's ``ParamWrapper``: ``W + (alpha / r) B A``
on the parameter itself, the same value) rather than ``target_modules``, for two reasons found in PEFT
0.21 with ``transformers`` 5: the router (``mlp.gate``) is a router module holding a ``weight``, not an
``nn.Linear``, and PEFT rewrites a target module named ``*.gate_proj`` / ``*.up_proj`` / ``*.down_proj`` /
``*.gate`` (Mixtral: ``*.w1`` / ``w2`` / ``w3`` / ``gate``) of these classes into the fused experts that
``transformers`` 4's checkpoints held under those names. PEFT refuses dropout on a parameter target, so
such an adapter is written with ``lora_dropout = 0`` (dropout acts in training only; the folder's logits
are the same).

The folder's ``base/`` holds the frozen base as a Hugging Face folder (QLoRA: the NF4 weights
dequantised, the values the run computed with), and ``base_model_name_or_path`` is its absolute path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.hf.files import write_json

PREFIX = "base_model.model."
MOE_TYPES = ("mixtral", "qwen2_moe", "glm4_moe")
SHOWN = 3  # adapted layers a refusal names before "and N more"


def hf_names(arch, cfg: Config, keys: list[str]) -> dict[str, str]:
    """lmforge tensor name -> Hugging Face tensor name of every tensor the architecture's export map
    renames without reshaping (``keys``: the plain model's tensor names); a map that renames nothing
    (GPT-2) is refused."""
    renames = getattr(arch, "renames", None)
    if renames is None:
        raise UserError(
            f"--adapter: the {cfg.model.arch} export reshapes weights, so LoRA adapters have no PEFT form; "
            "export merged weights (drop --adapter)"
        )
    wanted = set(keys)
    return {ours: theirs for ours, theirs in renames(cfg.model) if ours in wanted}


def adapted_modules(arch, cfg: Config, keys: list[str], layers: list[str]) -> dict[str, str]:
    """Each adapted lmforge layer (``layers``) -> the Hugging Face module ``transformers`` 5 loads its
    weight into; refused in one line, before anything is written, where a layer's weight is not renamed
    as it is (the layers named, and the fix)."""
    names = hf_names(arch, cfg, keys)
    missing = [layer for layer in layers if f"{layer}.weight" not in names]
    if missing:
        more = f" and {len(missing) - SHOWN} more" if len(missing) > SHOWN else ""
        raise UserError(
            f"--adapter: the adapted layers {', '.join(missing[:SHOWN])}{more} have no Hugging Face module of "
            f"their own in the {arch.MODEL_TYPE} export (their weights are reshaped), so they have no PEFT "
            "form; train without them in lora.targets, or export merged weights (drop --adapter)"
        )
    module_name = getattr(arch, "module_name", lambda name: name)
    return {layer: module_name(names[f"{layer}.weight"]).removesuffix(".weight") for layer in layers}


def by_parameter(arch, module: str) -> bool:
    """Whether PEFT adapts ``module`` through ``target_parameters`` (the mixture-of-experts classes' layers
    outside attention; the module docstring says why)."""
    return arch.MODEL_TYPE in MOE_TYPES and ".self_attn." not in module


def adapter_config(arch, cfg: Config, modules: list[str], base: Path) -> dict:
    """``adapter_config.json`` of adapters on the Hugging Face ``modules``, over the base folder ``base``."""
    params = sorted(f"{m}.weight" for m in modules if by_parameter(arch, m))
    lora = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base.resolve()),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if params else lora.dropout,  # PEFT has no dropout on parameter targets
        "target_modules": sorted(m for m in modules if not by_parameter(arch, m)),
        "target_parameters": params or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def adapter_files(
    out: Path, arch, cfg: Config, state: dict[str, torch.Tensor], base_keys: list[str], base: Path
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` of ``state``'s adapters into ``out``
    (``base``: the base folder ``base_model_name_or_path`` names)."""
    layers = sorted(k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A"))
    modules = adapted_modules(arch, cfg, base_keys, layers)
    tensors = {}
    for layer, module in modules.items():
        for part in ("lora_A", "lora_B"):
            tensors[f"{PREFIX}{module}.{part}.weight"] = state[f"{layer}.{part}"].contiguous()
    write_json(out / "adapter_config.json", adapter_config(arch, cfg, list(modules.values()), base))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
