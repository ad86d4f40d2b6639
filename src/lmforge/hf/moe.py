"""What the mixture-of-experts maps share (``mixtral.py``, ``qwen2_moe.py``, ``glm4_moe.py``): which
Hugging Face class reproduces an lmforge MoE model's routing exactly, the refusals where none does, the
experts' tensors (lmforge's 3-D ``[E, d_in, d_out]`` parameters <-> one ``Linear`` weight per expert, as
the Hub's checkpoints hold them and ``transformers`` 5 fuses on load), and which blocks are MoE blocks.

Routing, lmforge (``model/moe.py``) against each class's router in ``transformers`` 5.24:

- ``MixtralForCausalLM``: ``softmax`` over all experts, top-k, always renormalised: lmforge with
  ``score = "softmax"``, ``normalize = true``, every block an MoE block, no shared experts.
- ``Qwen2MoeForCausalLM``: ``softmax``, top-k, renormalised when ``norm_topk_prob``; dense blocks listed
  in ``mlp_only_layers``; its shared expert is always there and gated by ``sigmoid(x w)``, which lmforge's
  ungated shared experts are not, so it is written with width 0 (an output of exactly 0): lmforge with
  ``score = "softmax"`` and no shared experts, ``normalize`` either way, any dense blocks.
- ``Glm4MoeForCausalLM``: ``sigmoid``, top-k of ``scores + e_score_correction_bias`` (the bias chooses,
  never weighs), renormalised when ``norm_topk_prob``, ungated shared experts of ``n_shared_experts x
  moe_intermediate_size`` units, the first ``first_k_dense_replace`` blocks dense, plain Llama attention
  with ``use_qk_norm = false`` and ``partial_rotary_factor = 1``; with ``n_group = topk_group = 1`` and
  ``routed_scaling_factor = 1`` its group step and scaling do nothing: lmforge with ``score = "sigmoid"``
  (balancing bias included) and ``every = 1``.

No class adds a balancing bias to softmax scores together with these layouts, and none has an ungated
shared expert under softmax routing: those lmforge settings are refused. The capacity factor drops
assignments in training only (evaluation is dropless, as every class is), so it exports.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.config import ModelConfig, MoEConfig
from lmforge.errors import UserError
from lmforge.hf.common import refuse_export, refuse_import, take
from lmforge.model.transformer import ff_width

# lmforge's training-only MoE keys: no class's config has them, so config.json carries them under this key
# (transformers keeps unknown keys as plain attributes) and the import puts them back
EXTRA = "lmforge_moe"
TRAINING_KEYS = ("capacity_factor", "aux_loss", "seq_aux_loss", "z_loss", "bias_update_rate")


def normalizes(m: MoEConfig) -> bool:
    """Whether lmforge divides the chosen scores by their sum (``normalize``'s default: sigmoid yes)."""
    return m.normalize if m.normalize is not None else m.score == "sigmoid"


def moe_blocks(model: ModelConfig) -> list[int]:
    """The indices of the MoE blocks."""
    return [i for i in range(model.n_layers) if model.moe.is_moe_block(i)]


def d_expert(model: ModelConfig) -> int:
    """Each routed expert's hidden width."""
    return model.moe.d_expert or ff_width(model)


def pick_class(model: ModelConfig) -> str:
    """The ``model_type`` whose routing is lmforge's for ``model.moe`` (``mixtral``, ``qwen2_moe`` or
    ``glm4_moe``); a setting none of them reproduces is refused, naming what to set."""
    m = model.moe
    if m.score == "sigmoid":
        if m.every != 1:
            raise refuse_export(
                "model.moe.every",
                m.every,
                "the sigmoid-routed class (Glm4Moe) makes every block after first_k_dense_replace an MoE "
                "block; export needs model.moe.every = 1",
            )
        if m.experts < 2:
            raise refuse_export(
                "model.moe.experts", m.experts, "Glm4Moe's router ranks its expert group by its top 2; use 2+"
            )
        return "glm4_moe"
    if m.bias_update_rate:
        raise refuse_export(
            "model.moe.bias_update_rate",
            m.bias_update_rate,
            "no Hugging Face MoE class with this layout adds a balancing bias to softmax scores; train "
            "with model.moe.score = 'sigmoid' (exports as Glm4Moe) or bias_update_rate = 0",
        )
    if m.shared_experts:
        raise refuse_export(
            "model.moe.shared_experts",
            m.shared_experts,
            "the softmax-routed classes (Qwen2-MoE) gate their shared expert by sigmoid(x w), lmforge's is "
            "ungated; train with model.moe.score = 'sigmoid' (exports as Glm4Moe) or shared_experts = 0",
        )
    if normalizes(m) and len(moe_blocks(model)) == model.n_layers:
        return "mixtral"
    return "qwen2_moe"


def training_extra(m: MoEConfig) -> dict[str, Any]:
    """``config.json``'s ``lmforge_moe`` entry: the training-only keys, for the import."""
    return {EXTRA: {k: getattr(m, k) for k in TRAINING_KEYS}}


def training_fields(hf: dict, path: str) -> dict[str, Any]:
    """The training-only ``model.moe`` keys of a ``config.json`` written by lmforge (none otherwise)."""
    extra = hf.get(EXTRA) or {}
    if not isinstance(extra, dict) or set(extra) - set(TRAINING_KEYS):
        raise refuse_import(path, EXTRA, extra, f"lmforge writes only the keys {', '.join(TRAINING_KEYS)}")
    return dict(extra)


def blocks_pattern(moe: set[int], n_layers: int, path: str, field: str) -> tuple[int, int]:
    """``(first_dense, every)`` whose MoE blocks are exactly ``moe``; a set lmforge cannot express is
    ``field``'s refusal."""
    if not moe:
        raise refuse_import(path, field, sorted(set(range(n_layers)) - moe), "every block is dense")
    first = min(moe)
    ordered = sorted(moe)
    every = ordered[1] - ordered[0] if len(ordered) > 1 else n_layers
    cfg = MoEConfig(experts=1, top_k=1, first_dense=first, every=every)
    if {i for i in range(n_layers) if cfg.is_moe_block(i)} != moe:
        raise refuse_import(
            path,
            field,
            sorted(set(range(n_layers)) - moe),
            "lmforge's MoE blocks are every k-th after the first dense ones",
        )
    return first, every


def experts_to_hf(
    state: dict[str, torch.Tensor], ours: str, theirs: str, names: tuple[str, str, str]
) -> dict[str, torch.Tensor]:
    """lmforge's ``{ours}experts.{gate,up,down}_proj`` (``[E, d, h]``, ``[E, d, h]``, ``[E, h, d]``) as one
    ``nn.Linear`` weight per expert: ``{theirs}experts.{j}.{name}.weight`` (``[h, d]`` / ``[d, h]``), the
    ``names`` of gate, up and down."""
    out = {}
    for mine, name in zip(("gate_proj", "up_proj", "down_proj"), names, strict=True):
        weight = state[f"{ours}experts.{mine}"]
        for j in range(weight.shape[0]):
            out[f"{theirs}experts.{j}.{name}.weight"] = weight[j].t().contiguous()
    return out


def _fused(tensors: dict, theirs: str, n: int, path: str) -> dict[str, torch.Tensor] | None:
    """``transformers`` 5's own layout (``experts.gate_up_proj`` ``[E, 2h, d]``, ``experts.down_proj``
    ``[E, d, h]``), as a model saved without reverting its conversion holds it; None if absent."""
    gate_up, down = tensors.get(f"{theirs}experts.gate_up_proj"), tensors.get(f"{theirs}experts.down_proj")
    if gate_up is None or down is None:
        return None
    if gate_up.shape[0] != n:
        raise UserError(
            f"{path}: {theirs}experts.gate_up_proj holds {gate_up.shape[0]} experts, config.json {n}"
        )
    gate, up = gate_up.chunk(2, dim=1)
    return {
        "gate_proj": gate.transpose(1, 2).contiguous(),
        "up_proj": up.transpose(1, 2).contiguous(),
        "down_proj": down.transpose(1, 2).contiguous(),
    }


def experts_from_hf(
    tensors: dict, ours: str, theirs: str, names: tuple[str, str, str], n: int, path: str
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`experts_to_hf` (``n`` experts); a fused ``transformers`` 5 layout is read too."""
    fused = _fused(tensors, theirs, n, path)
    if fused is not None:
        return {f"{ours}experts.{k}": v for k, v in fused.items()}
    out = {}
    for mine, name in zip(("gate_proj", "up_proj", "down_proj"), names, strict=True):
        rows = []
        for j in range(n):
            key = f"{theirs}experts.{j}.{name}.weight"
            if key not in tensors:
                raise UserError(
                    f"{path}: the safetensors files have no tensor {key}; give a complete checkpoint"
                )
            rows.append(tensors[key].t())
        out[f"{ours}experts.{mine}"] = torch.stack(rows).contiguous()
    return out


def tensors_to_hf(
    state: dict[str, torch.Tensor],
    pairs: list[tuple[str, str]],
    experts: list[tuple[str, str]],
    names: tuple[str, str, str],
) -> dict[str, torch.Tensor]:
    """lmforge state -> a class's tensors: ``pairs`` renamed, and each MoE block's experts
    (``experts``: (lmforge prefix, Hugging Face prefix)) split into per-expert weights named ``names``."""
    out = {theirs: state[ours] for ours, theirs in pairs}
    for ours, theirs in experts:
        out.update(experts_to_hf(state, ours, theirs, names))
    return out


def tensors_from_hf(
    tensors: dict[str, torch.Tensor],
    model: ModelConfig,
    pairs: list[tuple[str, str]],
    experts: list[tuple[str, str]],
    names: tuple[str, str, str],
    path: str,
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`tensors_to_hf`; each MoE block's balancing bias is zero (the caller sets
    it where the class has one) and a tied head shares the embedding."""
    out = {ours: take(tensors, theirs, path) for ours, theirs in pairs}
    for ours, theirs in experts:
        out.update(experts_from_hf(tensors, ours, theirs, names, model.moe.experts, path))
        out[f"{ours}expert_bias"] = torch.zeros(model.moe.experts)
    if model.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    return out
