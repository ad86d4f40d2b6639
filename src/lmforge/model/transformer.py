"""A decoder-only transformer, GPT-2 or Llama style, from one :class:`ModelConfig`.

The model is plain PyTorch: blocks are separate modules in a ``ModuleList`` and every projection is its
own ``nn.Linear`` with a clear name (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; ``gate_proj``,
``up_proj``, ``down_proj`` or ``fc_in``, ``fc_out``), so parallelism and checkpointing can be applied
from outside. Nothing here assumes it sees the whole batch or the whole weight.

With ``model.mup`` the model follows muP (formulas and reference in ``lmforge/model/init.py``): hidden
matrices are initialised by width, attention logits are scaled by ``1 / d_head`` and output logits by
``1 / width_mult``; :meth:`Transformer.param_lr_scales` gives the optimizer the per-matrix learning-rate
multipliers.

``loss`` returns the *sum* of token cross-entropies and the number of target tokens; the trainer
divides by the number of target tokens of the whole optimizer step (all micro-batches, all ranks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.attention import apply_rope, attend, document_causal_mask, flex_block_mask, rope_cache
from lmforge.model.init import attention_scale, init_weights, logit_scale, mup_lr_scales, width_mult


def ff_width(cfg: ModelConfig) -> int:
    """MLP hidden width: given, else 4*d (gpt2) or 8/3*d rounded up to a multiple of 64 (llama)."""
    if cfg.d_ff:
        return cfg.d_ff
    if cfg.arch == "gpt2":
        return 4 * cfg.d_model
    return 64 * math.ceil(8 * cfg.d_model / 3 / 64)


def uses_bias(cfg: ModelConfig) -> bool:
    return cfg.bias if cfg.bias is not None else cfg.arch == "gpt2"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        bias = uses_bias(cfg)
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=bias)
        self.scale = attention_scale(self.head_dim, cfg.mup_base_width // cfg.n_heads, cfg.mup)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask, block_mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v, mask=mask, block_mask=block_mask, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, bias = ff_width(cfg), uses_bias(cfg)
        self.gate_proj = nn.Linear(cfg.d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(cfg.d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """``fc_out(gelu(fc_in(x)))`` (tanh approximation, as GPT-2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden, bias = ff_width(cfg), uses_bias(cfg)
        self.fc_in = nn.Linear(cfg.d_model, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=uses_bias(cfg))


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.arch == "llama" else GeluMLP(cfg)

    def forward(self, x: torch.Tensor, rope, mask, block_mask) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask, block_mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """``attention`` (kernel) and ``loss_chunk`` are execution settings (``train.*``): they do not change
    the function the model computes."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        max_seq_len: int,
        attention: str = "auto",
        loss_chunk: int = 1024,
    ):
        super().__init__()
        self.cfg, self.vocab_size, self.max_seq_len = cfg, vocab_size, max_seq_len
        self.attention, self.loss_chunk = attention, loss_chunk
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.arch == "llama":
            cos, sin = rope_cache(cfg.d_model // cfg.n_heads, max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.width_mult = width_mult(cfg.d_model, cfg.mup_base_width, cfg.mup)
        self.logit_scale = logit_scale(self.width_mult)
        init_weights(self, cfg.init_std, cfg.n_layers, self.width_mult)

    def param_lr_scales(self) -> dict[str, float]:
        """Learning-rate multiplier per parameter name where it is not 1 (muP's hidden matrices)."""
        return mup_lr_scales(self, self.width_mult)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (shared tensors once); by default without input token/position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if not self.cfg.tie_embeddings:
                n -= self.embed.weight.numel()
            if self.pos_embed is not None:
                n -= self.pos_embed.weight.numel()
        return n

    def use_flex(self, device: torch.device) -> bool:
        kind = self.attention
        return kind == "flex" or (kind == "auto" and device.type == "cuda")

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, d_model) after the last norm."""
        t = input_ids.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.max_seq_len}")
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(t, device=input_ids.device))
        rope = (self.rope_cos[:t], self.rope_sin[:t]) if self.cfg.arch == "llama" else None
        mask = block_mask = None
        if doc_ids is not None and self.cfg.doc_mask:
            if self.use_flex(input_ids.device):
                block_mask = flex_block_mask(doc_ids)
            else:
                mask = document_causal_mask(doc_ids)
        for block in self.blocks:
            x = block(x, rope, mask, block_mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``, times ``1 / width_mult`` under muP."""
        out = self.lm_head(hidden)
        return out * self.logit_scale if self.logit_scale != 1.0 else out

    def loss(
        self, input_ids: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of token cross-entropies in FP32, number of targets != -100).

        The output head and softmax run over chunks of ``loss_chunk`` tokens so the full (tokens x
        vocab) logits never exist in FP32 at once.
        """
        hidden = self(input_ids, doc_ids).flatten(0, 1)
        targets = targets.flatten()
        chunk = self.loss_chunk or hidden.shape[0]
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.split(chunk), targets.split(chunk), strict=True):
            logits = self.logits(h).float()
            total = total + F.cross_entropy(logits, y, ignore_index=-100, reduction="sum")
        return total, (targets != -100).sum()
