"""lmforge ``arch = "gpt2"`` <-> ``transformers``' ``GPT2LMHeadModel``: the config keys and tensor names.

GPT-2's projections are ``Conv1D`` layers whose weight is stored (in, out), the transpose of
``nn.Linear``'s (out, in): every block matrix is transposed on the way out and back on the way in. Its
attention has one fused ``c_attn`` for q, k and v (concatenated along the output dimension, in that
order), so GQA (``model.n_kv_heads`` < ``n_heads``) and a model without biases cannot be expressed.
lmforge's GELU is the tanh approximation (``F.gelu(approximate="tanh")``), exported as
``gelu_pytorch_tanh`` (the same call); ``gelu_new`` (the same formula, written out) is accepted on import.

Per block ``i`` (``transformer.h.i.`` on the Hugging Face side):

    blocks.i.attn_norm.*               ln_1.*
    blocks.i.attn.{q,k,v}_proj.*       attn.c_attn.*      (cat along out, weight transposed)
    blocks.i.attn.o_proj.*             attn.c_proj.*      (weight transposed)
    blocks.i.mlp_norm.*                ln_2.*
    blocks.i.mlp.fc_in.*               mlp.c_fc.*         (weight transposed)
    blocks.i.mlp.fc_out.*              mlp.c_proj.*       (weight transposed)
    embed.weight, pos_embed.weight     transformer.wte.weight, transformer.wpe.weight
    norm.*                             transformer.ln_f.*
    lm_head.weight                     lm_head.weight     (absent when tied)
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig
from lmforge.hf.common import check_mup, flag, model_config, refuse_export, refuse_import, take
from lmforge.model.transformer import ff_width, uses_bias

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
_MUST_BE = {  # config.json switches lmforge's GPT-2 has at these values only
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


def config_to_hf(model: ModelConfig, vocab_size: int, max_len: int, eot_id: int) -> dict[str, Any]:
    """The ``config.json`` of ``model``; GQA, a model without biases and muP off its base width are refused."""
    check_mup(model)
    if (model.n_kv_heads or model.n_heads) != model.n_heads:
        raise refuse_export("model.n_kv_heads", model.n_kv_heads, "GPT-2's fused c_attn has no GQA")
    if not uses_bias(model):
        raise refuse_export("model.bias", model.bias, "GPT-2 has biases in every linear layer and norm")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "n_positions": max_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layers,
        "n_head": model.n_heads,
        "n_inner": ff_width(model),
        "activation_function": GELU_TANH[0],
        "layer_norm_epsilon": model.norm_eps,
        "initializer_range": model.init_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        **_MUST_BE,
        "tie_word_embeddings": model.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": "float32",
    }


def config_from_hf(hf: dict, path: str) -> tuple[ModelConfig, int]:
    """(``model.*``, context length) of a ``GPT2LMHeadModel`` ``config.json``."""
    act = flag(hf, "activation_function", "gelu_new")
    if act not in GELU_TANH:
        raise refuse_import(
            path, "activation_function", act, "lmforge's GPT-2 MLP uses tanh-approximate GELU"
        )
    for key, want in _MUST_BE.items():
        if key in hf and hf[key] is not None and bool(hf[key]) != want:
            raise refuse_import(path, key, hf[key], f"lmforge's GPT-2 attention has it {want}")
    d = int(hf["n_embd"])
    fields = {
        "arch": "gpt2",
        "n_layers": int(hf["n_layer"]),
        "d_model": d,
        "n_heads": int(hf["n_head"]),
        "d_ff": int(flag(hf, "n_inner", 4 * d)),
        "tie_embeddings": bool(flag(hf, "tie_word_embeddings", True)),
        "norm_eps": float(flag(hf, "layer_norm_epsilon", 1e-5)),
        "init_std": float(flag(hf, "initializer_range", 0.02)),
    }
    return model_config(path, fields), int(hf["n_positions"])


def _plain(n_layers: int, tied: bool) -> list[tuple[str, str, bool]]:
    """(lmforge name, Hugging Face name, transposed) of every tensor but the fused q/k/v."""
    pairs = [
        ("embed.weight", "transformer.wte.weight", False),
        ("pos_embed.weight", "transformer.wpe.weight", False),
        ("norm.weight", "transformer.ln_f.weight", False),
        ("norm.bias", "transformer.ln_f.bias", False),
    ]
    if not tied:
        pairs.append(("lm_head.weight", "lm_head.weight", False))
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for mine, name in (
            ("attn_norm", "ln_1"),
            ("mlp_norm", "ln_2"),
            ("attn.o_proj", "attn.c_proj"),
            ("mlp.fc_in", "mlp.c_fc"),
            ("mlp.fc_out", "mlp.c_proj"),
        ):
            conv = not mine.endswith("norm")
            pairs.append((f"{ours}{mine}.weight", f"{theirs}{name}.weight", conv))
            pairs.append((f"{ours}{mine}.bias", f"{theirs}{name}.bias", False))
    return pairs


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """lmforge model state -> ``GPT2LMHeadModel`` tensors (Conv1D weights transposed, q/k/v fused)."""
    out = {}
    for ours, theirs, conv in _plain(model.n_layers, model.tie_embeddings):
        out[theirs] = state[ours].t().contiguous() if conv else state[ours]
    for i in range(model.n_layers):
        p, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
        out[h + "weight"] = torch.cat([state[f"{p}{x}_proj.weight"] for x in "qkv"]).t().contiguous()
        out[h + "bias"] = torch.cat([state[f"{p}{x}_proj.bias"] for x in "qkv"])
    return out


def state_from_hf(tensors: dict[str, torch.Tensor], model: ModelConfig, path: str) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel`` tensors -> lmforge model state (a tied head shares the embedding)."""
    out = {}
    for ours, theirs, conv in _plain(model.n_layers, model.tie_embeddings):
        value = take(tensors, theirs, path)
        out[ours] = value.t().contiguous() if conv else value
    for i in range(model.n_layers):
        p, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
        weight = take(tensors, h + "weight", path).t().contiguous().chunk(3)
        bias = take(tensors, h + "bias", path).chunk(3)
        for x, w, b in zip("qkv", weight, bias, strict=True):
            out[f"{p}{x}_proj.weight"], out[f"{p}{x}_proj.bias"] = w.contiguous(), b.contiguous()
    if model.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out
