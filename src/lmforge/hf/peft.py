"""``lmforge export RUN --adapter``: a LoRA run as a PEFT adapter folder over its base.

PEFT (``peft.PeftModel.from_pretrained(base, folder)``) reads ``adapter_config.json`` and
``adapter_model.safetensors``. Each adapted layer's tensors are named as PEFT saves them:
``base_model.model.<Hugging Face module name>.lora_A.weight`` ([r, d_in]) and ``.lora_B.weight``
([d_out, r]); PEFT scales ``B A x`` by ``lora_alpha / r``, as lmforge does. The Hugging Face module name is
the one the architecture's export map gives the layer's weight; a map that reshapes tensors rather than
renaming them (GPT-2's fused, transposed ``c_attn``) has no adapter form and is refused (export merged
weights instead). The folder's ``base/`` holds the frozen base as a Hugging Face folder (QLoRA: the NF4
weights dequantised, the values the run computed with), and ``base_model_name_or_path`` is its absolute
path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.hf.files import write_json

PREFIX = "base_model.model."


def hf_names(arch, cfg: Config, keys: list[str]) -> dict[str, str]:
    """lmforge tensor name -> Hugging Face tensor name, from the architecture's export map applied to the
    names themselves; refused where the map does more than rename."""
    try:
        renamed = arch.state_to_hf({k: k for k in keys}, cfg.model)
    except (TypeError, AttributeError, RuntimeError):
        renamed = None
    if renamed is None or not all(isinstance(v, str) for v in renamed.values()):
        raise UserError(
            f"--adapter: the {cfg.model.arch} export reshapes weights, so LoRA adapters have no PEFT form; "
            "export merged weights (drop --adapter)"
        )
    return {ours: theirs for theirs, ours in renamed.items()}


def adapter_files(
    out: Path, arch, cfg: Config, state: dict[str, torch.Tensor], base_keys: list[str], base: Path
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` of ``state``'s adapters into ``out``
    (``base``: the base folder ``base_model_name_or_path`` names)."""
    names = hf_names(arch, cfg, base_keys)
    layers = sorted(k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A"))
    modules = {layer: names[f"{layer}.weight"].removesuffix(".weight") for layer in layers}
    tensors = {}
    for layer, module in modules.items():
        for part in ("lora_A", "lora_B"):
            tensors[f"{PREFIX}{module}.{part}.weight"] = state[f"{layer}.{part}"].contiguous()
    lora = cfg.lora
    write_json(
        out / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(base.resolve()),
            "r": lora.rank,
            "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout,
            "target_modules": sorted(modules.values()),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
        },
    )
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
