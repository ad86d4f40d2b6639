"""lmforge ``arch = "llama"`` <-> ``transformers``' ``LlamaForCausalLM``: the config keys and tensor names.

Rotary convention: lmforge applies RoPE in the "rotate half" layout (``apply_rope``: the head dimension
is split in two halves ``[a, b]`` and rotated as ``[-b, a]``, frequency ``i`` pairing channels ``i`` and
``i + d/2``). ``LlamaForCausalLM`` applies ``rotate_half`` the same way to unpermuted ``q_proj`` /
``k_proj`` outputs, so the weights map one to one with NO permutation of the q/k rows. The permutation
in ``transformers``' ``convert_llama_weights_to_hf`` exists only because Meta's original checkpoints use
the interleaved (complex pair) layout, channels ``2i`` and ``2i + 1``; lmforge never did.
``tests/test_hf_export.py`` shows it: the exported model's logits match lmforge's, and the same weights
with q/k rows permuted the Meta way give different logits.

Per block ``i`` (``model.layers.i.`` on the Hugging Face side):

    blocks.i.attn_norm.weight        input_layernorm.weight
    blocks.i.attn.{q,k,v,o}_proj.*   self_attn.{q,k,v,o}_proj.*     (biases with model.bias = true)
    blocks.i.mlp_norm.weight         post_attention_layernorm.weight
    blocks.i.mlp.{gate,up,down}_proj mlp.{gate,up,down}_proj.*
    embed.weight                     model.embed_tokens.weight
    norm.weight                      model.norm.weight
    lm_head.weight                   lm_head.weight                  (absent when tied)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.hf.common import Problem, check_mup, flag, model_config, refuse_export, refuse_fields, take
from lmforge.model.transformer import ff_width, uses_bias

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def config_to_hf(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model`` (every dense lmforge llama is expressible but muP off its base
    width; mixtures of experts export through ``hf/moe.py``)."""
    check_mup(model)
    if model.moe.experts:
        raise refuse_export(
            "model.moe.experts",
            model.moe.experts,
            "a mixture of experts exports as an MoE class (hf/moe.py), not LlamaForCausalLM",
        )
    bias = uses_bias(model)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **base_config(model, vocab_size, max_len, eot_id),
        "intermediate_size": ff_width(model),
        "attention_bias": bias,
        "mlp_bias": bias,
    }


def base_config(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` keys every Llama-like class shares (sizes, attention, RoPE, norms, tokens)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": model.d_model,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads or model.n_heads,
        "head_dim": model.d_model // model.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "initializer_range": model.init_std,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,  # transformers 4.x reads this key
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},  # 5.x this one
        "tie_word_embeddings": model.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": "float32",
    }


def _rope_problems(hf: dict) -> list[Problem]:
    """A ``config.json``'s rotary settings other than plain RoPE (lmforge's only kind)."""
    if hf.get("rope_scaling"):
        return [("rope_scaling", hf["rope_scaling"], "lmforge has plain RoPE only")]
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        return [("rope_parameters.rope_type", kind, "lmforge has plain RoPE only")]
    return []


def config_from_hf(hf: dict, path: str) -> tuple[ModelConfig, int]:
    """(``model.*``, context length) of a ``LlamaForCausalLM`` ``config.json``."""
    attn_bias, mlp_bias = bool(flag(hf, "attention_bias", False)), bool(flag(hf, "mlp_bias", False))
    problems: list[Problem] = []
    if attn_bias != mlp_bias:
        problems.append(("mlp_bias", mlp_bias, "lmforge's model.bias covers attention and MLP alike"))
    fields = {
        **base_fields(hf, path, problems),
        "d_ff": int(hf["intermediate_size"]),
        "bias": True if attn_bias else None,
    }
    return model_config(path, fields), int(hf["max_position_embeddings"])


def base_problems(hf: dict) -> list[Problem]:
    """What lmforge's attention lacks among the keys every Llama-like ``config.json`` shares: sliding
    windows, other activations, a head size of its own, rotary scaling."""
    problems: list[Problem] = []
    act = flag(hf, "hidden_act", "silu")
    if act != "silu":
        problems.append(("hidden_act", act, "lmforge's llama MLP is SwiGLU (silu)"))
    for key in ("sliding_window", "use_sliding_window", "layer_types", "no_rope_layers"):
        if hf.get(key) and not (key == "layer_types" and set(hf[key]) == {"full_attention"}):
            problems.append((key, hf[key], "lmforge attends over the whole context in every layer"))
    heads, d = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = flag(hf, "head_dim", d // heads)
    if head_dim * heads != d:
        problems.append(
            ("head_dim", head_dim, f"lmforge's head dimension is hidden_size / heads ({d} / {heads})")
        )
    return problems + _rope_problems(hf)


def base_fields(hf: dict, path: str, problems: Sequence[Problem] = ()) -> dict[str, Any]:
    """The ``model.*`` fields of the keys every Llama-like ``config.json`` shares. Refused in one line:
    :func:`base_problems` together with the class's own ``problems`` (every field named at once)."""
    problems = [*problems, *base_problems(hf)]
    if problems:
        raise refuse_fields(path, problems)
    heads, d = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    kv = int(flag(hf, "num_key_value_heads", heads))
    params = hf.get("rope_parameters") or {}
    return {
        "arch": "llama",
        "n_layers": int(hf["num_hidden_layers"]),
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": None if kv == heads else kv,
        "tie_embeddings": bool(flag(hf, "tie_word_embeddings", False)),
        "rope_theta": float(params.get("rope_theta", flag(hf, "rope_theta", 10000.0))),
        "norm_eps": float(flag(hf, "rms_norm_eps", 1e-6)),
        "init_std": float(flag(hf, "initializer_range", 0.02)),
    }


def base_pairs(
    n_layers: int, bias: bool, tied: bool, mlp: Callable[[int], list[tuple[str, str]]]
) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor: embedding, head, norms, attention, and block
    ``i``'s feed-forward as ``mlp(i)`` gives them."""
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not tied:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    kinds = ("weight", "bias") if bias else ("weight",)
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        pairs.append((ours + "attn_norm.weight", theirs + "input_layernorm.weight"))
        pairs.append((ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight"))
        for name in _LINEARS:
            mine = name.replace("self_attn.", "attn.")
            pairs += [(f"{ours}{mine}.{k}", f"{theirs}{name}.{k}") for k in kinds]
        pairs += mlp(i)
    return pairs


def mlp_pairs(ours: str, theirs: str, bias: bool = False) -> list[tuple[str, str]]:
    """The SwiGLU MLP's three projections under the prefixes ``ours`` / ``theirs`` (same names)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return [(f"{ours}{name}.{k}", f"{theirs}{name}.{k}") for name in _MLP for k in kinds]


def _pairs(n_layers: int, bias: bool, tied: bool) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor."""
    return base_pairs(
        n_layers, bias, tied, lambda i: mlp_pairs(f"blocks.{i}.mlp.", f"model.layers.{i}.mlp.", bias)
    )


def renames(model: ModelConfig) -> list[tuple[str, str]]:
    """(lmforge name, Hugging Face name) of every tensor the export renames without reshaping: all of them
    (``hf/peft.py`` names the adapters' modules by it)."""
    return _pairs(model.n_layers, uses_bias(model), model.tie_embeddings)


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """lmforge model state -> ``LlamaForCausalLM`` tensors (same values, new names)."""
    return {theirs: state[ours] for ours, theirs in renames(model)}


def state_from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` tensors -> lmforge model state (a tied head shares the embedding)."""
    pairs = _pairs(model.n_layers, uses_bias(model), model.tie_embeddings)
    out = {ours: take(tensors, theirs, path) for ours, theirs in pairs}
    if model.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out
