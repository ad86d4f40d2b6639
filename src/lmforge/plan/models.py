"""Named model sizes as lmforge :class:`~lmforge.config.ModelConfig` values, with vocabulary and sequence length.

==========  ======  =====  =====  ====  ======  =======  =====  ====  ===========================================
name        arch    d      L      H     kv      d_ff     vocab  T     source
==========  ======  =====  =====  ====  ======  =======  =====  ====  ===========================================
gpt2-124m   gpt2    768    12     12    12      3072     50257  1024  Radford et al. 2019 (GPT-2 small), tied head
llama-1b    llama   2048   16     32    8       8192     128256 8192  Llama 3.2 1B model card (tied head)
llama-7b    llama   4096   32     32    32      11008    32000  2048  Touvron et al. 2023 (LLaMA), Table 2
llama-13b   llama   5120   40     40    40      13824    32000  2048  Touvron et al. 2023 (LLaMA), Table 2
llama-65b   llama   8192   80     64    64      22016    32000  2048  Touvron et al. 2023 (LLaMA), Table 2
llama-70b   llama   8192   80     64    8       28672    32000  4096  Touvron et al. 2023 (Llama 2), GQA 8 groups
gpt3-175b   gpt2    12288  96     96    96      49152    50257  2048  Brown et al. 2020, Table 2.1 (GPT-2 arch)
==========  ======  =====  =====  ====  ======  =======  =====  ====  ===========================================

lmforge's ``llama`` arch is the LLaMA block (RMSNorm, SwiGLU, RoPE, no biases), so its parameter counts
equal the published ones (6.74B, 13.0B, 65.2B, 69.0B); ``gpt2`` has biases, LayerNorm and learned positions
(GPT-3 175B: 174.6B without the position table, as Brown et al. count). RoPE bases (Llama 3.2: 500,000)
do not change memory and are left at lmforge's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config import ModelConfig


@dataclass(frozen=True)
class NamedModel:
    name: str
    model: ModelConfig
    vocab_size: int
    seq_len: int
    source: str


def _llama(d: int, layers: int, heads: int, kv: int, ff: int, tie: bool = False) -> ModelConfig:
    return ModelConfig(
        arch="llama", d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, d_ff=ff, tie_embeddings=tie
    )


def _gpt(d: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        arch="gpt2", d_model=d, n_layers=layers, n_heads=heads, d_ff=4 * d, tie_embeddings=True
    )


MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel("gpt2-124m", _gpt(768, 12, 12), 50257, 1024, "Radford et al. 2019, GPT-2 small"),
        NamedModel(
            "llama-1b", _llama(2048, 16, 32, 8, 8192, tie=True), 128256, 8192, "Llama 3.2 1B model card"
        ),
        NamedModel("llama-7b", _llama(4096, 32, 32, 32, 11008), 32000, 2048, "Touvron et al. 2023, Table 2"),
        NamedModel("llama-13b", _llama(5120, 40, 40, 40, 13824), 32000, 2048, "Touvron et al. 2023, Table 2"),
        NamedModel("llama-65b", _llama(8192, 80, 64, 64, 22016), 32000, 2048, "Touvron et al. 2023, Table 2"),
        NamedModel("llama-70b", _llama(8192, 80, 64, 8, 28672), 32000, 4096, "Touvron et al. 2023 (Llama 2)"),
        NamedModel("gpt3-175b", _gpt(12288, 96, 96), 50257, 2048, "Brown et al. 2020, Table 2.1"),
    )
}


def get(name: str) -> NamedModel:
    """The named size; KeyError lists the known names."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]
