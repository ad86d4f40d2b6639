"""lmforge MoE (softmax, renormalised, every block MoE, no shared experts) <-> ``MixtralForCausalLM``.

Per block ``i`` (``model.layers.i.`` on the Hugging Face side), besides Llama's attention and norms
(``llama.py``), with ``j`` each expert:

    blocks.i.mlp.router.weight            block_sparse_moe.gate.weight             [E, d]
    blocks.i.mlp.experts.gate_proj[j]     block_sparse_moe.experts.j.w1.weight     transposed: [h, d]
    blocks.i.mlp.experts.up_proj[j]       block_sparse_moe.experts.j.w3.weight     [h, d]
    blocks.i.mlp.experts.down_proj[j]     block_sparse_moe.experts.j.w2.weight     [d, h]

This is the Hub's Mixtral layout, which ``transformers`` 4 reads as it is and 5 fuses on load into
``mlp.experts.gate_up_proj`` ``[E, 2h, d]`` (w1 rows then w3 rows) and ``mlp.experts.down_proj``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.hf.common import check_mup, flag, model_config
from lmforge.hf.llama import base_config, base_fields, base_pairs
from lmforge.hf.moe import d_expert, tensors_from_hf, tensors_to_hf, training_extra, training_fields

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
NAMES = ("w1", "w3", "w2")


def config_to_hf(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (``hf/moe.py::pick_class`` chose Mixtral)."""
    check_mup(model)
    m = model.moe
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **base_config(model, vocab_size, max_len, eot_id),
        "intermediate_size": d_expert(model),
        "num_local_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        **training_extra(m),
    }


def config_from_hf(hf: dict, path: str) -> tuple[ModelConfig, int]:
    """(``model.*``, context length) of a ``MixtralForCausalLM`` ``config.json``."""
    width = int(hf["intermediate_size"])
    moe = {
        "experts": int(hf["num_local_experts"]),
        "top_k": int(flag(hf, "num_experts_per_tok", 2)),
        "d_expert": width,
        "score": "softmax",
        "normalize": True,
        **training_fields(hf, path),
    }
    return model_config(path, {**base_fields(hf, path), "d_ff": width, "moe": moe}), int(
        hf["max_position_embeddings"]
    )


def _maps(model: ModelConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(renamed pairs, expert prefixes) of every tensor."""

    def mlp(i: int) -> list[tuple[str, str]]:
        return [(f"blocks.{i}.mlp.router.weight", f"model.layers.{i}.block_sparse_moe.gate.weight")]

    pairs = base_pairs(model.n_layers, False, model.tie_embeddings, mlp)
    experts = [(f"blocks.{i}.mlp.", f"model.layers.{i}.block_sparse_moe.") for i in range(model.n_layers)]
    return pairs, experts


def renames(model: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor the export renames without reshaping: all but the
    routed experts' (``hf/peft.py`` names the adapters' modules by it)."""
    return _maps(model)[0]


def module_name(name: str) -> str:
    """The module ``transformers`` 5 loads the checkpoint tensor ``name`` into: the Hub's
    ``block_sparse_moe.*`` is its ``mlp.*`` (the router ``mlp.gate``); attention keeps its names."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """lmforge model state -> ``MixtralForCausalLM`` tensors."""
    return tensors_to_hf(state, *_maps(model), NAMES)


def state_from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    """``MixtralForCausalLM`` tensors -> lmforge model state."""
    return tensors_from_hf(tensors, model, *_maps(model), NAMES, path)
