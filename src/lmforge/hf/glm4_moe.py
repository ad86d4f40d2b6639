"""lmforge MoE (sigmoid scores, ``every = 1``; shared experts, the first blocks dense and the balancing
bias all expressible) <-> ``Glm4MoeForCausalLM``.

Per block ``i`` (``model.layers.i.``), besides Llama's attention and norms: the first
``first_k_dense_replace`` blocks' ``blocks.i.mlp.{gate,up,down}_proj`` are ``mlp.{gate,up,down}_proj``
(``intermediate_size`` wide); an MoE block's router is ``mlp.gate.weight``, its balancing bias
``blocks.i.mlp.expert_bias`` is ``mlp.gate.e_score_correction_bias`` (written as zeros when
``bias_update_rate = 0``, where lmforge routes without it), expert ``j``'s projections
``mlp.experts.j.{gate,up,down}_proj.weight`` (transposed) and the shared experts
``blocks.i.mlp.shared.*`` are ``mlp.shared_experts.*`` (``n_shared_experts x moe_intermediate_size``
units; without them the class's shared MLP is written empty, ``[0, d]`` / ``[d, 0]``, and adds exactly 0).

The class has no switch for the bias: it always chooses by ``scores + e_score_correction_bias``, while
lmforge adds its bias only when ``bias_update_rate > 0``. So a config.json lmforge did not write imports
with ``bias_update_rate = 0.001`` (DeepSeek-V3's rate), which routes with the checkpoint's bias.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.hf.common import Problem, check_mup, flag, model_config
from lmforge.hf.llama import base_config, base_fields, base_pairs, mlp_pairs
from lmforge.hf.moe import (
    EXTRA,
    d_expert,
    moe_blocks,
    normalizes,
    tensors_from_hf,
    tensors_to_hf,
    training_extra,
    training_fields,
)
from lmforge.model.transformer import ff_width

ARCHITECTURE = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
NAMES = ("gate_proj", "up_proj", "down_proj")
FOREIGN_BIAS_RATE = 0.001


def config_to_hf(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (``hf/moe.py::pick_class`` chose GLM-4 MoE)."""
    check_mup(model)
    m, base = model.moe, base_config(model, vocab_size, max_len, eot_id)
    base["rope_parameters"]["partial_rotary_factor"] = 1.0  # the class's default is 0.5
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **base,
        "partial_rotary_factor": 1.0,
        "intermediate_size": ff_width(model),
        "moe_intermediate_size": d_expert(model),
        "n_routed_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": m.shared_experts,
        "first_k_dense_replace": m.first_dense,
        "norm_topk_prob": normalizes(m),
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "use_qk_norm": False,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        **training_extra(m),
    }


def _problems(hf: dict) -> list[Problem]:
    """What the class can do and lmforge's model cannot (docs/hf.md's table), each with what lmforge reads."""
    rope = hf.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))  # the class's default
    values = {
        "partial_rotary_factor": factor,
        "use_qk_norm": flag(hf, "use_qk_norm", False),
        "attention_bias": flag(hf, "attention_bias", False),
        "n_group": flag(hf, "n_group", 1),
        "routed_scaling_factor": flag(hf, "routed_scaling_factor", 1.0),
    }
    wrong = {
        "partial_rotary_factor": (
            float(factor) != 1.0,
            "lmforge rotates every channel of a head (an absent key means the class's 0.5); lmforge reads "
            "partial_rotary_factor = 1 only",
        ),
        "use_qk_norm": (
            bool(values["use_qk_norm"]),
            "lmforge has no query/key norms; lmforge reads use_qk_norm = false only",
        ),
        "attention_bias": (
            bool(values["attention_bias"]),
            "q_proj, k_proj and v_proj then have biases, lmforge's MoE attention has none; lmforge reads "
            "attention_bias = false only",
        ),
        "n_group": (
            int(values["n_group"]) != 1,
            "lmforge routes over all experts, not groups of them; lmforge reads n_group = 1 only",
        ),
        "routed_scaling_factor": (
            float(values["routed_scaling_factor"]) != 1.0,
            "lmforge does not scale the routed experts' sum; lmforge reads routed_scaling_factor = 1 only",
        ),
    }
    return [(key, values[key], why) for key, (bad, why) in wrong.items() if bad]


def config_from_hf(hf: dict, path: str) -> tuple[ModelConfig, int]:
    """(``model.*``, context length) of a ``Glm4MoeForCausalLM`` ``config.json``; what lmforge's model
    lacks is refused in one line naming every such field (:func:`_problems`, ``llama.py::base_problems``)."""
    base = base_fields(hf, path, _problems(hf))
    routing = {
        "experts": int(hf["n_routed_experts"]),
        "top_k": int(flag(hf, "num_experts_per_tok", 8)),
        "d_expert": int(hf["moe_intermediate_size"]),
        "shared_experts": int(flag(hf, "n_shared_experts", 1)),
        "first_dense": int(flag(hf, "first_k_dense_replace", 1)),
        "score": "sigmoid",
        "normalize": bool(flag(hf, "norm_topk_prob", True)),
        **(training_fields(hf, path) if EXTRA in hf else {"bias_update_rate": FOREIGN_BIAS_RATE}),
    }
    fields = {**base, "d_ff": int(hf["intermediate_size"]), "moe": routing}
    return model_config(path, fields), int(hf["max_position_embeddings"])


def _maps(model: ModelConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    moe = set(moe_blocks(model))

    def mlp(i: int) -> list[tuple[str, str]]:
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        if i not in moe:
            return mlp_pairs(ours, theirs)
        pairs = [(ours + "router.weight", theirs + "gate.weight")]
        if model.moe.shared_experts:
            pairs += mlp_pairs(ours + "shared.", theirs + "shared_experts.")
        return pairs

    pairs = base_pairs(model.n_layers, False, model.tie_embeddings, mlp)
    return pairs, [(f"blocks.{i}.mlp.", f"model.layers.{i}.mlp.") for i in sorted(moe)]


def renames(model: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor the export renames without reshaping: all but the
    routed experts' (``hf/peft.py`` names the adapters' modules by it)."""
    return _maps(model)[0]


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """lmforge model state -> ``Glm4MoeForCausalLM`` tensors."""
    out = tensors_to_hf(state, *_maps(model), NAMES)
    d = model.d_model
    for i in moe_blocks(model):
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        bias = state[ours + "expert_bias"].float()
        out[theirs + "gate.e_score_correction_bias"] = (
            bias if model.moe.bias_update_rate else torch.zeros_like(bias)
        )
        if not model.moe.shared_experts:
            out[theirs + "shared_experts.gate_proj.weight"] = torch.zeros(0, d)
            out[theirs + "shared_experts.up_proj.weight"] = torch.zeros(0, d)
            out[theirs + "shared_experts.down_proj.weight"] = torch.zeros(d, 0)
    return out


def state_from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    """``Glm4MoeForCausalLM`` tensors -> lmforge model state (the correction bias as the balancing bias)."""
    out = tensors_from_hf(tensors, model, *_maps(model), NAMES, path)
    for i in moe_blocks(model):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if name in tensors:
            out[f"blocks.{i}.mlp.expert_bias"] = tensors[name].float()
    return out
