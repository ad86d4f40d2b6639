"""Training FLOPs per token (pure formulas)."""

from __future__ import annotations

from lmforge.config import ModelConfig
from lmforge.plan.memory import ParamTensor, active_param_count, param_tensors


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * d_model * seq_len``.

    ``6N``: forward (2N) plus backward (4N) multiply-adds of the weight matrices, with ``N`` the
    non-embedding parameters plus the output head (embedding look-ups cost no FLOPs). ``12 * L * d * T``:
    the attention score and value products (``QK^T`` and ``AV``: 2 * 2 * d * T forward per layer, times 3
    with backward), counted over the full T x T square as in PaLM's MFU definition (Chowdhery et al. 2022,
    appendix B).
    """
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``tokens_per_s * flops_per_token / peak_flops``."""
    return tokens_per_s * flops_per_tok / peak_flops if peak_flops > 0 else 0.0


def model_flops_per_token(cfg: ModelConfig, vocab_size: int, seq_len: int) -> float:
    """:func:`flops_per_token` of ``Transformer(cfg, vocab_size, seq_len)``: ``N`` is the parameters a
    token uses, ``plan/memory.py::active_param_count``, less the input embeddings (token and position
    tables; a tied table is the output head and counts).

    Mixture of experts: in each MoE block a token runs ``k = top_k`` of the ``E`` routed experts, each a
    SwiGLU of ``3 d f_e`` weights, plus the router ``d E`` (its FP32 logits, forward and backward) and the
    shared experts ``3 d (s f_e)``; so ``N`` counts ``k``, not ``E``, routed experts:
    ``N_active = N - (E - k) 3 d f_e`` per MoE block, and ``6 N_active + 12 L d T`` per token. Not
    counted (as for dense blocks, which leave out norms and element-wise work): the routing's softmax,
    top-k, sort and gathers, the weighting of the ``T k`` expert outputs and their scatter-add. A model
    whose MoE blocks have ``E = k`` experts of width ``f_e`` costs what a dense model of MLP width
    ``k f_e`` does, plus the router's ``6 d E``."""
    tensors = param_tensors(cfg, vocab_size, seq_len)
    n = active_param_count(cfg, vocab_size, seq_len) - lookup_params(tensors)
    return flops_per_token(n, cfg.n_layers, cfg.d_model, seq_len)


def lookup_params(tensors: list[ParamTensor]) -> int:
    """Parameters of the input embeddings (no FLOPs: look-ups): the token and position tables, unless
    the output head is tied to them (then the table is a linear layer too)."""
    return sum(t.numel for t in tensors if t.name in ("embed.weight", "pos_embed.weight") and not t.linear)
