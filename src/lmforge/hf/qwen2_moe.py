"""lmforge MoE (softmax, no shared experts, any dense blocks, ``normalize`` either way) <->
``Qwen2MoeForCausalLM``.

Per block ``i`` (``model.layers.i.``), besides Llama's attention (``qkv_bias = false``) and norms: a
dense block's ``blocks.i.mlp.{gate,up,down}_proj`` is ``mlp.{gate,up,down}_proj`` (``intermediate_size``
wide; listed in ``mlp_only_layers``); an MoE block's router is ``mlp.gate.weight`` and expert ``j``'s
three projections ``mlp.experts.j.{gate,up,down}_proj.weight`` (transposed: ``[h, d]``, ``[h, d]``,
``[d, h]``). The class always builds a shared expert gated by ``sigmoid(x w)``; lmforge's MoE blocks have
none here, so ``shared_expert_intermediate_size = 0``: its projections are empty (``[0, d]``, ``[d, 0]``)
and add exactly 0, and ``mlp.shared_expert_gate.weight`` is zero.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.hf.common import Problem, check_mup, flag, model_config
from lmforge.hf.llama import base_config, base_fields, base_pairs, mlp_pairs
from lmforge.hf.moe import (
    blocks_pattern,
    d_expert,
    moe_blocks,
    normalizes,
    tensors_from_hf,
    tensors_to_hf,
    training_extra,
    training_fields,
)
from lmforge.model.transformer import ff_width

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"
NAMES = ("gate_proj", "up_proj", "down_proj")


def config_to_hf(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (``hf/moe.py::pick_class`` chose Qwen2-MoE)."""
    check_mup(model)
    m, moe = model.moe, set(moe_blocks(model))
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **base_config(model, vocab_size, max_len, eot_id),
        "intermediate_size": ff_width(model),
        "moe_intermediate_size": d_expert(model),
        "shared_expert_intermediate_size": 0,
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": normalizes(m),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(model.n_layers) if i not in moe],
        "qkv_bias": False,
        "use_sliding_window": False,
        **training_extra(m),
    }


def _problems(hf: dict) -> list[Problem]:
    """What the class can do and lmforge's model cannot, both set in the released checkpoints and in
    ``Qwen2MoeConfig``'s defaults (docs/hf.md's table): a shared expert (always gated) and q/k/v biases."""
    problems: list[Problem] = []
    shared = flag(hf, "shared_expert_intermediate_size", 5632)  # an absent key: the class's default
    if shared:
        why = (
            "Qwen2-MoE gates its shared expert by sigmoid(x w), lmforge's shared experts are ungated; "
            "lmforge reads shared_expert_intermediate_size = 0 only"
        )
        problems.append(("shared_expert_intermediate_size", shared, why))
    if flag(hf, "qkv_bias", True):  # an absent key: the class's default, true
        why = (
            "q_proj, k_proj and v_proj then have biases (an absent key means true), lmforge's MoE attention "
            "has none; lmforge reads qkv_bias = false only"
        )
        problems.append(("qkv_bias", True, why))
    return problems


def config_from_hf(hf: dict, path: str) -> tuple[ModelConfig, int]:
    """(``model.*``, context length) of a ``Qwen2MoeForCausalLM`` ``config.json``; what lmforge's model
    lacks is refused in one line naming every such field (:func:`_problems`, ``llama.py::base_problems``)."""
    fields = base_fields({k: v for k, v in hf.items() if k != "sliding_window"}, path, _problems(hf))
    n, step = fields["n_layers"], int(flag(hf, "decoder_sparse_step", 1))
    dense = set(flag(hf, "mlp_only_layers", []))
    moe = {i for i in range(n) if i not in dense and (i + 1) % step == 0}
    first, every = blocks_pattern(moe, n, path, "mlp_only_layers")
    routing = {
        "experts": int(hf["num_experts"]),
        "top_k": int(flag(hf, "num_experts_per_tok", 4)),
        "d_expert": int(hf["moe_intermediate_size"]),
        "score": "softmax",
        "normalize": bool(flag(hf, "norm_topk_prob", False)),
        "first_dense": first,
        "every": every,
        **training_fields(hf, path),
    }
    fields.update(d_ff=int(hf["intermediate_size"]), moe=routing)
    return model_config(path, fields), int(hf["max_position_embeddings"])


def _maps(model: ModelConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    moe = set(moe_blocks(model))

    def mlp(i: int) -> list[tuple[str, str]]:
        ours, theirs = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        return [(ours + "router.weight", theirs + "gate.weight")] if i in moe else mlp_pairs(ours, theirs)

    pairs = base_pairs(model.n_layers, False, model.tie_embeddings, mlp)
    return pairs, [(f"blocks.{i}.mlp.", f"model.layers.{i}.mlp.") for i in sorted(moe)]


def renames(model: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor the export renames without reshaping: all but the
    routed experts' (``hf/peft.py`` names the adapters' modules by it)."""
    return _maps(model)[0]


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """lmforge model state -> ``Qwen2MoeForCausalLM`` tensors (with the empty shared expert)."""
    out = tensors_to_hf(state, *_maps(model), NAMES)
    d = model.d_model
    for i in moe_blocks(model):
        theirs = f"model.layers.{i}.mlp.shared_expert"
        out[f"{theirs}.gate_proj.weight"] = torch.zeros(0, d)
        out[f"{theirs}.up_proj.weight"] = torch.zeros(0, d)
        out[f"{theirs}.down_proj.weight"] = torch.zeros(d, 0)
        out[f"{theirs}_gate.weight"] = torch.zeros(1, d)
    return out


def state_from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    """``Qwen2MoeForCausalLM`` tensors -> lmforge model state (the empty shared expert is dropped)."""
    return tensors_from_hf(tensors, model, *_maps(model), NAMES, path)
