"""A decoder-only transformer, GPT-2 or Llama style, from one :class:`ModelConfig`.

The model is plain PyTorch: blocks are separate modules in a ``ModuleList`` and every projection is its
own ``nn.Linear`` with a clear name (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; ``gate_proj``,
``up_proj``, ``down_proj`` or ``fc_in``, ``fc_out``), so parallelism and checkpointing can be applied
from outside. Nothing here assumes it sees the whole batch or the whole weight.

With ``model.mup`` the model follows muP (formulas and reference in ``lmforge/model/init.py``): hidden
matrices are initialised by width, attention logits are scaled by ``1 / d_head`` and output logits by
``1 / width_mult``; :meth:`Transformer.param_lr_scales` gives the optimizer the per-matrix learning-rate
multipliers.

The model is only the network: ``forward`` returns the final hidden states, ``logits`` applies the
output head; the loss is its own module (``lmforge/model/loss.py``). Construction allocates but does not
initialise: build on the meta device, :meth:`Transformer.materialize` on the target device, then
:meth:`Transformer.init_weights` (or load a checkpoint). Blocks live in an ``nn.ModuleDict`` keyed by
their index, so a pipeline stage can drop the blocks it does not own (and the embedding or the head)
and keep the parameter names of the whole model (:func:`keep_stage`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.attention import apply_rope, attend, document_causal_mask, flex_block_mask, rope_cache
from lmforge.model.head import OutputHead
from lmforge.model.init import (
    InitStep,
    attention_scale,
    init_plan,
    init_weights,
    logit_scale,
    mup_lr_scales,
    width_mult,
)
from lmforge.model.kv_cache import KVCache, LayerCache
from lmforge.model.moe import MoE


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
        # called with (q, k) after RoPE when set: the detail metrics' attention entropy
        # (``train/callbacks/detail.py``) sets it for one measuring forward; None otherwise
        self.probe: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values (B, heads, T, head_dim) of ``x``, RoPE applied where ``rope`` is given."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, mask, block_mask):
        q, k, v = self.qkv(x, rope)
        if self.probe is not None:
            self.probe(q, k)
        y = attend(q, k, v, mask=mask, block_mask=block_mask, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(*x.shape[:2], -1))

    def forward_cached(self, x: torch.Tensor, rope, cache: LayerCache, mask: torch.Tensor) -> torch.Tensor:
        """Inference over new positions only: their keys and values are appended to ``cache`` and the
        queries attend to every cached position that ``mask`` (B, 1, T, cached + T) allows; ``rope``: the
        tables at each row's positions (B, 1, T, D)."""
        q, k, v = self.qkv(x, rope)
        k, v = cache.append(k, v)
        y = attend(q, k, v, mask=mask, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(*x.shape[:2], -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (``hidden``: the width, default :func:`ff_width`)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden, bias = hidden or ff_width(cfg), uses_bias(cfg)
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


def make_mlp(cfg: ModelConfig, index: int, moe_kernel: str = "auto") -> nn.Module:
    """Block ``index``'s feed-forward: an MoE layer (``model/moe.py``) where ``model.moe`` makes it one,
    else SwiGLU (llama) or the GELU MLP (gpt2)."""
    if cfg.moe.is_moe_block(index):
        m, hidden = cfg.moe, cfg.moe.d_expert or ff_width(cfg)
        shared = SwiGLU(cfg, m.shared_experts * hidden) if m.shared_experts else None
        return MoE(cfg, hidden, moe_kernel, shared)
    return SwiGLU(cfg) if cfg.arch == "llama" else GeluMLP(cfg)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (``mlp``: :func:`make_mlp`).

    ``runner`` is how the block runs its layers: ``None`` calls :meth:`layers` directly; activation
    checkpointing (``lmforge/parallel/apply.py``) sets it to ``runner(layers, x, rope, mask, block_mask)``
    (``torch.utils.checkpoint`` around them). It is a plain attribute, not a module, so parameter names
    stay ``blocks.<i>.attn.q_proj.weight`` whatever the policy; it runs inside the block's call, so hooks
    on the block (FSDP2's all-gather) and ``Module.compile`` of the block see the checkpoint inside.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0, moe_kernel: str = "auto"):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg, index, moe_kernel)
        self.runner: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, rope, mask, block_mask) -> torch.Tensor:
        if self.runner is None:
            return self.layers(x, rope, mask, block_mask)
        return self.runner(self.layers, x, rope, mask, block_mask)

    def layers(self, x: torch.Tensor, rope, mask, block_mask) -> torch.Tensor:
        """The block's computation (what a checkpoint recomputes)."""
        x = x + self.attn(self.attn_norm(x), rope, mask, block_mask)
        return x + self.mlp(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, rope, cache: LayerCache, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`layers` over new positions against the block's key/value cache (generation)."""
        x = x + self.attn.forward_cached(self.attn_norm(x), rope, cache, mask)
        return x + self.mlp(self.mlp_norm(x))


class Blocks(nn.ModuleDict):
    """The blocks, keyed by their index in the whole model (``"0"``, ``"1"``, ...); ``blocks[i]`` also
    takes an int. A pipeline stage deletes the ones it does not own; the rest keep their names."""

    def __getitem__(self, key: str | int) -> nn.Module:
        return super().__getitem__(str(key))


class Transformer(nn.Module):
    """Decoder-only transformer. ``attention`` (an execution setting, ``train.attention``) picks the
    kernel: ``auto`` = FlexAttention on CUDA with a document mask, else SDPA; ``moe_kernel``
    (``train.moe_kernel``) the MoE experts' matrix products (``model/moe.py``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        max_seq_len: int,
        attention: str = "auto",
        moe_kernel: str = "auto",
    ):
        super().__init__()
        self.cfg, self.vocab_size, self.max_seq_len = cfg, vocab_size, max_seq_len
        self.attention = attention
        self.embed: nn.Embedding | None = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.blocks = Blocks({str(i): Block(cfg, i, moe_kernel) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.lm_head: OutputHead | None = OutputHead(cfg.d_model, vocab_size)
        self.tie_weights()
        self.width_mult = width_mult(cfg.d_model, cfg.mup_base_width, cfg.mup)
        self.logit_scale = logit_scale(self.width_mult)
        self.reset_buffers()

    def tie_weights(self) -> None:
        """Share the embedding with the output head (``model.tie_embeddings``) when the model has both."""
        if self.cfg.tie_embeddings and self.embed is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed.weight

    def tied_copies(self) -> dict[str, str]:
        """Parameters that hold a copy of another name's tensor rather than that tensor itself:
        ``{"lm_head.weight": "embed.weight"}`` when ``model.tie_embeddings`` and this module's output head
        is not the embedding's own tensor (a pipeline stage without the embedding, or a rank whose two
        stages keep a copy each: ``parallel/tied_embedding.py``), else empty. Whoever holds the copies
        apart keeps them equal; norms count such a copy once, the optimizer groups it with its original
        and checkpoints store its optimizer state under the original's name."""
        tied = self.cfg.tie_embeddings and self.lm_head is not None
        if tied and (self.embed is None or self.lm_head.weight is not self.embed.weight):
            return {"lm_head.weight": "embed.weight"}
        return {}

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the non-persistent buffers (RoPE tables) on ``device`` (default: the parameters') and
        zero the MoE layers' buffers (their balancing bias, which a checkpoint then loads, and counters)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()
        if self.cfg.arch != "llama":
            return
        device = device if device is not None else next(self.parameters()).device
        cos, sin = rope_cache(self.cfg.d_model // self.cfg.n_heads, self.max_seq_len, self.cfg.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def materialize(self, device: torch.device | str) -> Transformer:
        """Allocate a meta-device model's storage on ``device`` (values undefined until
        :meth:`init_weights` or ``load_state_dict``), re-tie shared weights and compute the buffers."""
        self.to_empty(device=device)
        self.tie_weights()
        self.reset_buffers()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter from the global RNG (standard or muP; ``lmforge/model/init.py``)."""
        init_weights(self, self.cfg.init_std, self.cfg.n_layers, self.width_mult)

    def init_plan(self) -> list[InitStep]:
        """How :meth:`init_weights` initialises each parameter, in order (``lmforge/model/init.py``); computed
        from names and shapes only, so a meta-device model gives it."""
        return init_plan(self, self.cfg.init_std, self.cfg.n_layers, self.width_mult)

    def param_lr_scales(self) -> dict[str, float]:
        """Learning-rate multiplier per parameter name where it is not 1 (muP's hidden matrices)."""
        return mup_lr_scales(self, self.width_mult)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (shared tensors once); by default without input token/position embeddings."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.embed is not None and not (self.cfg.tie_embeddings and self.lm_head is not None):
                n -= self.embed.weight.numel()
            if self.pos_embed is not None:
                n -= self.pos_embed.weight.numel()
        return n

    def use_flex(self, device: torch.device) -> bool:
        return self.attention == "flex" or (self.attention == "auto" and device.type == "cuda")

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, d_model), after the final norm where the model has it.

        A pipeline stage without the embedding takes hidden states (B, T, d_model) instead of ids and,
        without the final norm, returns its last block's output.
        """
        t = x.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds max_seq_len {self.max_seq_len}")
        device = x.device
        if self.embed is not None:
            x = self.embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(t, device=device))
        rope = (self.rope_cos[:t], self.rope_sin[:t]) if self.cfg.arch == "llama" else None
        mask = block_mask = None
        if doc_ids is not None and self.cfg.doc_mask:
            if self.use_flex(device):
                block_mask = flex_block_mask(doc_ids)
            else:
                mask = document_causal_mask(doc_ids)
        for block in self.blocks.values():
            x = block(x, rope, mask, block_mask)
        return self.norm(x) if self.norm is not None else x

    def forward_cached(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor):
        """Token ids (B, T) at ``positions`` (B, T) -> hidden states (B, T, d_model), computing only these
        positions: each block's keys and values of earlier ones come from ``cache`` (``model/kv_cache.py``),
        which receives theirs. ``mask`` (B, 1, T, cached + T): which cached and new positions each query
        sees. Generation only (no document mask, no pipeline stage)."""
        x = self.embed(ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        rope = None
        if self.cfg.arch == "llama":
            rope = (self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        for block, layer in zip(self.blocks.values(), cache.layers, strict=True):
            x = block.forward_cached(x, rope, layer, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``, times ``1 / width_mult`` under muP: the whole vocabulary's logits (under
        tensor parallelism gathered from the vocabulary shards). Training computes its loss without them
        (``lmforge/model/loss.py``)."""
        if self.lm_head is None:
            raise RuntimeError("this pipeline stage has no output head")
        out = self.lm_head(hidden)
        return out * self.logit_scale if self.logit_scale != 1.0 else out


def keep_stage(model: Transformer, layers: range) -> Transformer:
    """Cut ``model`` in place down to one pipeline stage owning the blocks ``layers``: the embedding
    stays only with block 0, the final norm and head only with the last block. Parameter names do not
    change (block ``i`` stays ``blocks.<i>``), so a stage's state dict is a slice of the whole one."""
    n = model.cfg.n_layers
    if not layers or layers.start < 0 or layers.stop > n or layers.step != 1:
        raise ValueError(f"stage layers {layers} must be a non-empty contiguous slice of 0..{n - 1}")
    for key in [k for k in model.blocks if int(k) not in layers]:
        del model.blocks[key]
    if layers.start > 0:
        model.embed = model.pos_embed = None
    if layers.stop < n:
        model.norm = model.lm_head = None
    return model
