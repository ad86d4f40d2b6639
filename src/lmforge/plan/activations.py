"""Activation memory of one micro-batch: the bytes kept alive between forward and backward (pure formulas).

:func:`activation_bytes` counts, part by part, every tensor lmforge's forward saves for backward (autograd's
saved tensors, non-reentrant checkpoint's saved block inputs, selective checkpointing's stored op outputs),
deduplicated by storage, parameters and buffers excluded: the quantity measured by
``lmforge.probes.activation_memory.saved_activation_bytes``. It never allocates. The formulas follow what
the eager ops of ``lmforge/model`` save, read from their saved tensors on torch 2.13 (CPU). Notation:

* ``B`` micro-batch, ``T`` sequence, ``N = B*T`` tokens, ``d`` model width, ``h`` query heads, ``g`` key /
  value heads, ``e = d / h`` head width, ``f`` MLP width, ``V`` vocabulary, ``c`` compute bytes (4: FP32,
  2: BF16/FP16 autocast), ``a = 1`` under autocast (``c < 4``) else ``0``; under tensor parallelism ``h``,
  ``g``, ``f`` are the per-rank shares ``/ tp`` and ``n = N / tp`` (sequence parallel), else ``n = N``.
* The residual stream is FP32 under FP32 and under autocast (FP32 master weights: the embedding output is
  FP32 and ``x + attn(...)`` promotes to FP32), so block inputs cost 4 bytes per value there.
* FSDP2's mixed precision (``fsdp_mixed_precision``: ZeRO-2/3 with a 16-bit compute dtype, BF16 for FP8
  too; ``parallel/data_parallel.py::apply_fsdp``) is another path: ``MixedPrecisionPolicy`` gathers the
  parameters in ``c`` and casts each block's floating inputs to ``c``, so the embedding, the residual
  stream and every norm output are ``c``-byte, nothing is cast by autocast (the weights are already
  ``c``), and the RoPE tables arrive cast once per block. Each difference is stated below as "FSDP2 mp";
  measured exact on 2 gloo processes for Llama (GQA) and GPT-2 under every policy (ZeRO-3 BF16, ZeRO-2
  BF16, FP16), and FP8 (tensorwise) adds one FP32 scale, 4 bytes, per float8 linear layer, not counted.

One block without checkpointing (policy ``none``), in bytes:

* residual: the block input and the mid-block sum, saved by the two norms: ``2 * 4 n d``. FSDP2 mp:
  ``2 * c n d`` (``c``-byte inputs), except the CPU RMSNorm, which upcasts its input to FP32 and saves
  that copy instead: ``2 * 4 n d`` (on CUDA the fused kernel saves the ``c``-byte input: derived).
* norms: RMSNorm (a composite on CPU: ``x * rsqrt(mean(x^2) + eps) * w``) saves ``rstd`` and
  ``x_hat = x * rstd``: ``2 * (4 n + 4 n d)`` (FP32 under FSDP2 mp too); on CUDA ``rms_norm`` dispatches
  to the fused ``_fused_rms_norm`` kernel, whose backward needs only the input and ``rstd``: ``2 * 4 n``
  (read from PyTorch's ``rms_norm_symint``, not measured here); LayerNorm (fused) saves mean and rstd:
  ``2 * 8 n``; FSDP2 mp on CPU: the CPU kernel returns them in the input's dtype, ``2 * 2 c n``.
* attention projections: the q/k/v input. FP32: the norm output once (the three matmuls share it),
  ``4 N d``; autocast: each projection casts its input to ``c`` separately (autocast caches only leaf
  weights), ``3 c N d``; FSDP2 mp: the norm's ``c``-byte output once, ``c N d``.
* rotary (Llama): FP32 saves nothing (the cos/sin tables are buffer slices); autocast saves the four
  ``cos/sin.to(c)`` copies (q and k): ``4 c T e``; FSDP2 mp: the block's cast of the two tables, shared
  by q and k, ``2 c T e``, kept by checkpointed blocks too (they are the checkpoint's inputs).
* attention kernel, ``flash`` (SDPA's flash / memory-efficient / CPU flash kernels): q, k, v, out at
  ``c`` and the FP32 log-sum-exp: ``4 c B h T e + 4 B h T``. lmforge repeats the K/V heads with
  ``repeat_interleave`` before SDPA (``attend``), so the saved k and v are ``h`` heads wide, not ``g``.
  ``o_proj``'s input is a view of the kernel's output (no extra bytes). ``flex`` (FlexAttention, called
  with ``enable_gqa``): q, out at ``h`` heads, k, v at ``g`` heads: ``2 c B (h + g) T e + 4 B h T``.
  ``math`` (SDPA's composite fallback): scaled q and k, v and the probabilities in the kernel's dtype
  ``m``, and ``o_proj``'s copied input: ``3 m B h T e + m B h T^2 + c B h T e``; the CPU math kernel
  upcasts BF16/FP16 inputs to FP32 (``m = 4``, measured), on CUDA ``m = c`` (not measured).
* attention mask (``model.doc_mask``, SDPA): the boolean ``(B, 1, T, T)`` document mask is converted
  inside SDPA to an additive mask in the compute dtype, which the kernel saves, once per block:
  ``c B T^2`` (``flash`` only; ``math`` adds the mask without saving it; ``flex`` has no dense mask).
* MLP: its input (FP32 ``4 N d``; autocast one cast per input projection, ``2 c N d`` SwiGLU,
  ``c N d`` GELU; FSDP2 mp the norm's output once, ``c N d``) plus SwiGLU's gate, silu(gate), up and
  their product ``4 c N f``, or GELU's pre-activation and output ``2 c N f``.
* autocast weight casts: each matmul saves its ``c``-byte weight copy, held by the graph until backward:
  ``c * (d h e + 2 d g e + h e d + k_mlp d f)`` with ``k_mlp`` 3 (SwiGLU) or 2 (GELU). They are counted as
  activations: they are created per forward and freed only by backward (``weight_casts``). FSDP2 mp: 0.

Mixture-of-experts blocks (``model/moe.py::MoE``; ``E`` experts, ``E_l = E / ep`` of them on this rank,
``k = top_k``, ``f_e`` an expert's width, ``s f_e`` the shared experts' width; ``R = N k`` routed rows,
every assignment computed, dropped ones too, at weight 0) replace the MLP part (``mlp``) by:

* ``mlp``: the router's input, the norm output in FP32, ``4 N d`` (FSDP2 mp: its ``.float()`` copy, and
  the router weight's FP32 copy ``4 E d``); the gathered rows, ``c R d`` (``flat[token]`` cast to
  ``c``; FP32: that copy itself); the experts' gate, silu(gate), up and product, ``4 c R f_e``; their
  output in FP32 (``.float()`` of the ``c``-byte output, or that output under FP32) and the weighted rows
  the scatter-add keeps as its source, ``2 * 4 R d``; the shared experts as a dense SwiGLU of width
  ``s f_e`` on the norm output (autocast: ``2 c N d`` of input casts, FSDP2 mp: the ``c``-byte norm
  output ``c N d``; all: ``4 c N s f_e``).
* ``routing``: the FP32 scores ``4 N E``; the top-k indices, each row's token and the sort order, int64,
  ``3 * 8 R``; the weights of the rows ``4 R`` (normalised: the chosen scores and their sum besides,
  ``4 R + 4 N``); a capacity's keep mask ``R`` (bool); ``torch._grouped_mm``'s group offsets, int32,
  ``3 * 4 E_l`` (the ``loop`` kernel has none); the balance losses that are on: Switch ``4 E``,
  sequence-wise ``4 B E``, z-loss ``4 N E + 4 N``, with sigmoid scores and a Switch or sequence-wise loss
  the scores' sum ``4 N``, and the layer's weighted loss ``4`` (a checkpointed block keeps that too). Under expert parallelism (derived, not
  measured) the arrived rows' regrouping order and its inverse, ``2 * 8 R`` (a balanced router: ``R``
  rows arrive), and the gathered rows are the arrived ones.
* ``weight_casts``: the experts' weights cast to ``c`` by ``.to`` (not autocast's cache), kept by the
  grouped products, ``c * 3 E_l d f_e`` (FSDP2 mp: none, gathered in ``c``, unless expert parallelism
  keeps them out of FSDP2), and the shared experts' autocast copies ``c * 3 d s f_e``; the router is
  never cast (FP32 logits). FSDP2 mp is derived, not measured; ``selective`` is not modelled for MoE
  blocks (ValueError).

Measured exact (``tests/test_moe_plan.py``) against ``saved_activation_bytes`` for one MoE layer and for
whole models, FP32 and BF16 autocast, softmax and sigmoid, shared experts, capacity, every balance loss.

Checkpointed blocks (``full``; ``every:K`` checkpoints block ``i`` when ``i % K == 0``) keep only their
input ``4 n d`` (saved by checkpoint's input saver; FSDP2 mp ``c n d`` and the RoPE casts ``2 c T e``)
and, once for all of them, the boolean document mask they take as an argument, ``B T^2`` (the RoPE
tables are buffer slices). ``selective`` keeps the block input, the outputs of every matmul
(``mm``/``addmm``/``bmm``) and of the attention kernel:
``4 n d + c N (h e + 2 g e) + c B h T e + 4 B h T + c N d + c N (k_mlp - 1) f + c N d`` (FSDP2 mp: the
input ``c n d``, plus ``2 c T e`` of RoPE casts; ``o_proj`` and ``down``/``fc_out`` outputs are full
``N d`` partial sums under tensor parallelism, whose two reduce-scatter outputs are kept too,
``+ 2 c n d``; the ``math`` kernel instead keeps its two ``bmm`` outputs ``m B h T^2 + m B h T e``).

Outside the blocks:

* embedding: GPT-2's position ids ``arange(T)``, ``8 T`` (the token ids are the caller's input and are
  not counted).
* head and loss (``loss``): the final norm as a block norm (input ``4 n d``, stats, RMSNorm's ``x_hat``;
  FSDP2 mp as the block norms above) on every rank's sequence shard. Then, by loss:

  - ``fused`` (``model/fused_loss.py``: the output head and the cross-entropy fused chunk by chunk in
    forward and backward), no logits, no weight cast and no compute-dtype copy of the input kept,
    whatever the chunk; one of two ways, as ``model/fused_loss.py::precomputes`` decides from ``N``,
    ``v = V / tp``, ``d``, the chunk and ``c``: recomputing keeps its input, the final norm's FP32
    output, ``4 N d`` (FSDP2 mp: ``c N d``), and one FP32 log-sum-exp per token, ``4 N``; precomputing
    (a summed loss whose two gradients are no larger than a chunk's temporaries) keeps the FP32
    gradients of the hidden states and of this rank's head rows, ``4 N d + 4 v d``. Under tensor
    parallelism the loss is vocabulary-parallel: each rank holds all ``N`` tokens' hidden states
    (all-gathered) and its ``V / tp`` rows (temporaries: ``plan/memory.py::loss_temporary``).
  - ``chunked`` (the chunked loss lmforge had before, a head then ``F.cross_entropy`` per chunk; measured
    exact): the head input (FP32: the norm output ``4 N d``; autocast: its cast per chunk, ``c N d``),
    the autocast copy of the head weight ``c V d`` (``/ tp``; FSDP2 mp: none), and every chunk's FP32
    log-softmax, alive until backward in eager, ``4 N V`` in all (the chunking bounds the temporary
    logits, not the saved log-probabilities), plus one 4-byte ``total_weight`` per chunk,
    ``4 ceil(N / chunk)``; under tensor parallelism the head input and the logits are all-gathered,
    full-size on every rank.

Two transients come on top of the saved bytes, at different moments (``peak = total + max(recompute,
forward_casts)``):

* ``recompute``, in backward: one checkpointed block's recomputation, its ``none`` bytes minus what it
  kept (gradients and temporaries not included).
* ``forward_casts``, at the end of forward (autocast only, not FSDP2 mp): autocast's cache keeps the
  ``c``-byte copy of every FP32 leaf weight it cast until the outermost autocast exits. A block that is
  not checkpointed saves its weight copies anyway (``weight_casts``); a checkpointed block's copies are
  held by the cache alone, as are every block's bias copies:
  ``c * (checkpointed * (d h e + 2 d g e + h e d + k_mlp d f)``
  ``+ blocks * ((h + 2 g) e + (k_mlp - 1) f + 2 d))``
  (biases only where the model has them). Measured exact in one process (the storages alive just before
  autocast exits less those backward keeps).

Tensor parallelism follows ``lmforge/parallel/tensor.py``: norms and residual on the sequence shard
(``n = N / tp``), each column-parallel matmul saves the all-gathered ``(N, d)`` input (or, under
autocast, its own cast of it), heads and MLP channels ``/ tp``, the mask, the RoPE casts, the head input
and the loss full-size on every rank. Measured exact at ``tp = 2`` (2 CPU processes, gloo, saved-tensor
hooks unwrapping DTensors) for ``none``, ``full`` and ``every:2`` in FP32 and BF16; ``selective`` under
TP is derived, not measured. FSDP2 mp under TP (or on a pipeline stage) takes the same substitutions as
without it: derived, not measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from lmforge.config import ModelConfig
from lmforge.model.fused_loss import precomputes
from lmforge.model.transformer import ff_width, uses_bias
from lmforge.precision import FP8_DIVISOR

ATTENTION_KINDS = ("flash", "flex", "math")
LOSSES = ("fused", "chunked")
TRANSIENT = ("recompute", "forward_casts")  # parts alive on top of the saved bytes, at different moments


def attention_kind(device_type: str, attention: str = "auto", doc_mask: bool = True) -> str:
    """The ``attention`` value of :func:`activation_bytes` a run gets.

    ``attention`` is ``train.attention``. FlexAttention runs where the model picks it
    (``Transformer.use_flex``): ``flex``, or ``auto`` on CUDA, and only with a document mask; otherwise
    SDPA, which on this torch (2.13) picks a fused kernel saving O(T) per head: on CPU
    ``_scaled_dot_product_flash_attention_for_cpu`` for ``is_causal=True`` and for the explicit boolean
    mask, in FP32, BF16 and FP16, at any head width (measured); on CUDA flash or memory-efficient.
    ``math`` (the O(T^2) composite) is what SDPA falls back to when no fused kernel fits; pass it
    explicitly when that is known to happen.
    """
    if doc_mask and (attention == "flex" or (attention == "auto" and device_type == "cuda")):
        return "flex"
    return "flash"


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes saved for backward of one micro-batch on one device, by part (sums over this device's
    blocks); :attr:`total` is their sum. Not in the total (:data:`TRANSIENT`): ``recompute``, the extra
    memory of one checkpointed block's recomputation during backward, and ``forward_casts``, autocast's
    cached 16-bit weight copies not saved by any op, alive until the forward's autocast exits:
    ``peak = total + max(recompute, forward_casts)``."""

    residual: int
    norms: int
    attention_proj: int
    rotary: int
    attention_kernel: int
    attention_mask: int
    mlp: int
    routing: int
    weight_casts: int
    embedding: int
    head: int
    loss: int
    recompute: int = 0
    forward_casts: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name not in TRANSIENT)

    @property
    def peak(self) -> int:
        """Saved bytes plus the larger transient on top of them: one block's recomputation (in backward)
        or autocast's cached weight casts (at the end of forward)."""
        return self.total + max(self.recompute, self.forward_casts)


def _checkpointed(policy: str, index: int) -> bool:
    """Whether block ``index`` is wrapped by the policy (``selective`` wraps every block too)."""
    if policy in ("full", "selective"):
        return True
    if policy.startswith("every:"):
        return index % int(policy.partition(":")[2]) == 0
    if policy == "none":
        return False
    raise ValueError(f"activation checkpointing policy {policy!r}: use none, full, selective or every:K")


def _add(parts: dict[str, int], **kw: int) -> None:
    for k, v in kw.items():
        parts[k] += v


@dataclass(frozen=True)
class _Dims:
    """The notation of the module docstring for one device (heads, MLP width and tokens already divided
    by ``tp`` where tensor parallelism divides them)."""

    B: int
    T: int
    N: int
    n: int
    d: int
    V: int
    h: int
    g: int
    e: int
    f: int
    c: int
    tp: int
    llama: bool
    k_mlp: int
    norm_stats: int  # what one norm saves besides its input
    norm_in: int  # bytes per value of the input copy a norm saves
    m: int  # the math kernel's dtype bytes
    mp: bool  # FSDP2's MixedPrecisionPolicy: parameters and block inputs already in the compute dtype
    fp8: bool = False  # train.precision = fp8: torchao's float8 linear layers in the blocks

    @property
    def ac(self) -> bool:
        """A 16-bit compute dtype (``c < 4``): autocast, or FSDP2's mixed precision (:attr:`mp`)."""
        return self.c < 4

    @property
    def casts(self) -> bool:
        """Autocast casts FP32 weights and inputs (16-bit compute without FSDP2's mixed precision)."""
        return self.ac and not self.mp

    @property
    def r(self) -> int:
        """Bytes per value of the residual stream: ``c`` under FSDP2's mixed precision, else 4."""
        return self.c if self.mp else 4


def _dims(
    model: ModelConfig,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    c: int,
    tp: int,
    device_type: str,
    mp: bool,
) -> _Dims:
    B, T, d = micro_batch, seq_len, model.d_model
    n = B * T // tp  # tokens of the sequence-parallel norms and residual stream
    llama = model.arch == "llama"
    mp = mp and c < 4
    composite_rms = llama and device_type != "cuda"  # CUDA has a fused RMSNorm kernel, CPU decomposes it
    # LayerNorm's mean and rstd: FP32 from FP32 inputs; the CPU kernel returns them in a 16-bit input's dtype
    ln_stat = c if (mp and device_type != "cuda") else 4
    norm_stats = (4 * n + 4 * n * d if composite_rms else 4 * n) if llama else 2 * ln_stat * n
    return _Dims(
        B=B, T=T, N=B * T, n=n, d=d, V=vocab_size,
        h=model.n_heads // tp, g=(model.n_kv_heads or model.n_heads) // tp, e=d // model.n_heads,
        f=ff_width(model) // tp, c=c, tp=tp, llama=llama, k_mlp=3 if llama else 2, norm_stats=norm_stats,
        norm_in=4 if (composite_rms or not mp) else c,  # the CPU RMSNorm saves its FP32 upcast
        m=4 if device_type == "cpu" else c,  # the math kernel's dtype: the CPU one upcasts to FP32
        mp=mp,
    )  # fmt: skip


def _block_weights(D: _Dims) -> int:
    """Values of one block's matmul weights on this device: ``d h e + 2 d g e + h e d + k_mlp d f``."""
    return D.d * D.h * D.e + 2 * D.d * D.g * D.e + D.h * D.e * D.d + D.k_mlp * D.d * D.f


def _linears(D: _Dims) -> list[tuple[int, int, int, int]]:
    """One block's matmuls as ``(whole in features, whole out features, local weight values, local bias
    values)``: q, k, v, o, then the MLP's."""
    q, kv, f, tp = D.h * D.e, D.g * D.e, D.f, D.tp
    mlp_in = [(D.d, f * tp, D.d * f, f)] * (D.k_mlp - 1)
    return [(D.d, q * tp, D.d * q, q), (D.d, kv * tp, D.d * kv, kv), (D.d, kv * tp, D.d * kv, kv),
            (q * tp, D.d, q * D.d, D.d), *mlp_in, (f * tp, D.d, f * D.d, D.d)]  # fmt: skip


def _cast(D: _Dims, bias: bool) -> int:
    """Values of one block's weights (``bias``: biases) that autocast casts to ``c``: every matmul's, but
    under FP8 (:attr:`_Dims.fp8`) not those of the float8 layers (``precision.py::fp8_takes``: both whole
    dimensions multiples of ``16 tp``), which take the FP32 weight itself and cast it to float8 inside
    torchao's matmul (nothing the autocast cache holds, nothing a 16-bit copy saves) and add their bias
    through an uncached ``.to``."""
    if not D.fp8:
        return _block_biases(D) if bias else _block_weights(D)
    div = FP8_DIVISOR * D.tp
    return sum((b if bias else w) for i, o, w, b in _linears(D) if i % div or o % div)


def _block_biases(D: _Dims) -> int:
    """Values of one block's matmul biases on this device (column-parallel ones ``/ tp``):
    ``(h + 2 g) e + (k_mlp - 1) f + 2 d``."""
    return (D.h + 2 * D.g) * D.e + (D.k_mlp - 1) * D.f + 2 * D.d


def _rotary(D: _Dims) -> int:
    """The RoPE tables' 16-bit copies one Llama block keeps: autocast, ``cos/sin.to(c)`` for q and for k,
    ``4 c T e``; FSDP2's mixed precision casts the block's floating inputs (the tables) once, ``2 c T e``,
    kept whether the block is checkpointed or not."""
    if not (D.ac and D.llama):
        return 0
    return 2 * D.c * D.T * D.e if D.mp else 4 * D.c * D.T * D.e


def _plain_block(D: _Dims, attention: str, doc_mask: bool) -> dict[str, int]:
    """What one block saves under policy ``none``, by part."""
    B, T, N, n, d, h, g, e, f, c, m = D.B, D.T, D.N, D.n, D.d, D.h, D.g, D.e, D.f, D.c, D.m
    if attention == "flash":
        kernel = 4 * c * B * h * T * e + 4 * B * h * T
    elif attention == "flex":
        kernel = 2 * c * B * (h + g) * T * e + 4 * B * h * T
    else:
        kernel = 3 * m * B * h * T * e + m * B * h * T * T + c * B * h * T * e
    # the matmuls' inputs: FP32 one shared copy; autocast one cast per projection; FSDP2's mixed
    # precision one shared 16-bit copy (the norm's output is already in the compute dtype)
    shared = c * N * d if D.mp else 4 * N * d
    return {
        "residual": 2 * D.norm_in * n * d,
        "norms": 2 * D.norm_stats,
        "attention_proj": 3 * c * N * d if D.casts else shared,
        "rotary": _rotary(D),
        "attention_kernel": kernel,
        "attention_mask": c * B * T * T if (doc_mask and attention == "flash") else 0,
        "mlp": ((D.k_mlp - 1) * c * N * d if D.casts else shared) + (4 if D.llama else 2) * c * N * f,
        "weight_casts": c * _cast(D, bias=False) if D.casts else 0,
    }


def _selective_block(D: _Dims, attention: str) -> dict[str, int]:
    """What one block keeps under ``selective``: its input, the matmul and attention kernel outputs."""
    B, T, N, n, d, h, g, e, f, c, m = D.B, D.T, D.N, D.n, D.d, D.h, D.g, D.e, D.f, D.c, D.m
    if attention == "math":
        kept_kernel = m * B * h * T * T + m * B * h * T * e
    else:
        kept_kernel = c * B * h * T * e + 4 * B * h * T
    reduce_scatter = c * n * d if D.tp > 1 else 0  # the selective policy keeps TP's reduce-scatter outputs
    return {
        "residual": D.r * n * d,
        "rotary": _rotary(D) if D.mp else 0,
        "attention_proj": c * N * (h + 2 * g) * e + c * N * d + reduce_scatter,
        "attention_kernel": kept_kernel,
        "mlp": c * N * (D.k_mlp - 1) * f + c * N * d + reduce_scatter,
    }


def _moe_block(D: _Dims, plain: dict[str, int], model: ModelConfig, ep: int) -> dict[str, int]:
    """What one MoE block saves under policy ``none`` (module docstring): ``plain``'s attention parts and
    the MoE layer's ``mlp``, ``routing`` and ``weight_casts``."""
    m = model.moe
    N, B, d, c = D.N, D.B, D.d, D.c
    e, k, el = m.experts, m.top_k, m.experts // ep
    fe = m.d_expert or ff_width(model)
    fs = m.shared_experts * fe // D.tp  # TP splits the shared experts only (every rank routes all N tokens)
    R = N * k
    mlp = 4 * N * d + (4 * e * d if D.mp else 0)  # the router's FP32 input (FSDP2 mp: and weight copies)
    mlp += c * R * d + 4 * c * R * fe + 2 * 4 * R * d  # rows, the experts' SwiGLU, outputs, weighted rows
    if fs:
        mlp += (2 * c * N * d if D.casts else c * N * d if D.mp else 0) + 4 * c * N * fs
    normalize = m.normalize if m.normalize is not None else m.score == "sigmoid"
    routing = 4 * N * e + 3 * 8 * R + 4 * R + (4 * R + 4 * N if normalize else 0)
    routing += (R if m.capacity_factor else 0) + 3 * 4 * el + (2 * 8 * R if ep > 1 else 0)
    routing += _balance_losses(N, B, m)
    attention_casts = D.d * D.h * D.e + 2 * D.d * D.g * D.e + D.h * D.e * D.d
    casts = c * (attention_casts + 3 * d * fs) if D.casts else 0
    if c < 4 and (not D.mp or ep > 1):  # the experts' ``.to(c)`` copies (FSDP2 mp gathers them in ``c``)
        casts += c * 3 * el * d * fe
    return {**plain, "mlp": mlp, "routing": routing, "weight_casts": casts}


def _balance_losses(N: int, B: int, m) -> int:
    """What the balance losses that are on save (module docstring)."""
    e, out = m.experts, 0
    if m.aux_loss or m.seq_aux_loss or m.z_loss:
        out += 4  # the layer's weighted loss, kept until the training module adds it
    out += 4 * e if m.aux_loss else 0
    out += 4 * B * e if m.seq_aux_loss else 0
    out += 4 * N * e + 4 * N if m.z_loss else 0
    if m.score == "sigmoid" and (m.aux_loss or m.seq_aux_loss):
        out += 4 * N  # the scores' sum, dividing them into a distribution
    return out


def _moe_forward_casts(D: _Dims, model: ModelConfig) -> int:
    """Values autocast's cache holds of one checkpointed MoE block: its attention weights and the
    shared experts' (the experts' own copies are ``.to`` casts, freed with the recomputed forward)."""
    fs = model.moe.shared_experts * (model.moe.d_expert or ff_width(model)) // D.tp
    return D.d * D.h * D.e + 2 * D.d * D.g * D.e + D.h * D.e * D.d + 3 * D.d * fs


def _head_and_loss(D: _Dims, loss: str, loss_chunk: int) -> dict[str, int]:
    """What the final norm, the head and the loss save (the stage holding the last block)."""
    N, n, d, V, c = D.N, D.n, D.d, D.V, D.c
    final_norm = D.norm_in * n * d + D.norm_stats
    if loss == "fused":
        v = V // D.tp
        if precomputes(N, v, d, loss_chunk, c):  # the FP32 gradients of the hidden states and the head rows
            return {"head": final_norm, "loss": 4 * N * d + 4 * v * d}
        return {"head": final_norm + D.r * N * d, "loss": 4 * N}  # its input, a log-sum-exp per token
    if loss == "chunked":
        return {
            "head": final_norm + (c * N * d if D.ac else 4 * N * d),
            "weight_casts": c * V * d // D.tp if D.casts else 0,
            "loss": 4 * N * V + 4 * math.ceil(N / (loss_chunk or N)),
        }
    raise ValueError(f"loss {loss!r}: use one of {', '.join(LOSSES)}")


def activation_bytes(
    model: ModelConfig,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    policy: str,
    compute_bytes: int,
    attention: str,
    loss_chunk: int,
    tp: int = 1,
    layers: int | None = None,
    first_layer: int = 0,
    device_type: str = "cpu",
    loss: str = "fused",
    fsdp_mixed_precision: bool = False,
    fp8: bool = False,
    ep: int = 1,
) -> ActivationBytes:
    """Bytes kept alive between forward and backward of one micro-batch of ``micro_batch x seq_len``
    tokens on one device (formulas in the module docstring).

    ``policy``: ``none``, ``full``, ``every:K`` or ``selective``; ``compute_bytes``: 4 (FP32) or 2
    (BF16/FP16 autocast); ``attention``: ``flash``, ``flex`` or ``math`` (:func:`attention_kind`);
    ``loss_chunk``: ``train.loss_chunk`` (0: one chunk); ``tp``: tensor-parallel degree; ``layers``: blocks
    on this device (a pipeline stage; default all) starting at block ``first_layer``: the embedding
    counts on the stage holding block 0, the final norm, head and loss on the one holding the last block.
    ``device_type``: ``cpu`` (measured) or ``cuda`` (fused RMSNorm saves no ``x_hat``; the math kernel
    computes in the compute dtype); ``loss``: ``fused`` or ``chunked``; ``fsdp_mixed_precision``: the
    blocks run under FSDP2's ``MixedPrecisionPolicy`` (``parallel/data_parallel.py::apply_fsdp``: ZeRO-2/3
    with a 16-bit compute dtype) instead of plain autocast over FP32 parameters (one process, DDP,
    ZeRO-1); ignored at ``compute_bytes`` 4; ``fp8``: ``train.precision = fp8`` (the blocks' float8 layers
    cast no weight copies); ``ep``: ``parallel.ep`` (an MoE block's experts on this rank). See the module
    docstring.
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention {attention!r}: use one of {', '.join(ATTENTION_KINDS)}")
    if compute_bytes not in (2, 4):
        raise ValueError(f"compute_bytes {compute_bytes}: 4 (fp32) or 2 (bf16/fp16 autocast)")
    layers = model.n_layers if layers is None else layers
    if layers < 1 or first_layer < 0 or first_layer + layers > model.n_layers:
        raise ValueError(
            f"blocks {first_layer}..{first_layer + layers - 1} are not within 0..{model.n_layers - 1}"
        )
    D = _dims(model, vocab_size, seq_len, micro_batch, compute_bytes, tp, device_type, fsdp_mixed_precision)
    D = replace(D, fp8=fp8)
    if model.moe.experts and policy == "selective":
        raise ValueError("selective checkpointing of MoE blocks is not modelled")
    dense = _plain_block(D, attention, model.doc_mask)
    moe = _moe_block(D, dense, model, ep) if model.moe.experts else dense
    full = {"residual": D.r * D.n * D.d, "rotary": _rotary(D) if D.mp else 0}
    kept = _selective_block(D, attention) if policy == "selective" else full

    parts = {field.name: 0 for field in fields(ActivationBytes) if field.name not in TRANSIENT}
    recompute, checkpointed, cached = 0, 0, 0
    for i in range(first_layer, first_layer + layers):
        is_moe = model.moe.is_moe_block(i)
        plain = moe if is_moe else dense
        if not _checkpointed(policy, i):
            _add(parts, **plain)
            continue
        checkpointed += 1
        cached += _moe_forward_casts(D, model) if is_moe else _cast(D, bias=False)
        _add(parts, **kept)
        m = model.moe
        if is_moe and (m.aux_loss or m.seq_aux_loss or m.z_loss):
            parts["routing"] += 4  # the layer's weighted balance loss
        recompute = max(recompute, sum(plain.values()) - sum(kept.values()))
    if checkpointed and model.doc_mask and attention != "flex":
        parts["attention_mask"] += (
            D.B * D.T * D.T
        )  # the boolean mask, an argument of every checkpointed block
    if first_layer == 0 and not D.llama:
        parts["embedding"] += 8 * D.T
    if first_layer + layers == model.n_layers:
        _add(parts, **_head_and_loss(D, loss, loss_chunk))
    forward_casts = 0
    if D.casts:  # autocast's cache: checkpointed blocks' weight casts, and every block's bias casts
        biases = _cast(D, bias=True) * layers if uses_bias(model) else 0
        forward_casts = D.c * (cached + biases)
    return ActivationBytes(**parts, recompute=recompute, forward_casts=forward_casts)


def split_backward_bytes(
    model: ModelConfig,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    compute_bytes: int,
    tp: int = 1,
    layers: int | None = None,
    first_layer: int = 0,
    loss: str = "fused",
    fsdp_mixed_precision: bool = False,
) -> tuple[int, int]:
    """``(retained, input_backward)`` of one micro-batch on a pipeline stage of a split-backward schedule
    (``zero_bubble``, ``zbv``: ``parallel/pipeline.py::SPLIT_BACKWARD``), whose backward runs in two
    actions: ``I``, the gradient of the stage's input only, then later ``W``, the weights'.

    ``retained``: what ``I`` leaves alive until its ``W`` on top of the saved activations (which stay too:
    ``I`` runs ``autograd.grad`` with ``retain_graph=True``). torch's ``stage_backward_input`` keeps the
    gradient arriving at every op of the stage that reads a weight (its "intermediates", the nodes ``W``
    starts from). Per block, in the notation of the module docstring: the two norms' outputs (``r``-byte:
    4, FSDP2 mp ``c``) and the outputs of q, k, v, o and the MLP's projections (``c``-byte)::

        r 2 n d + c N ((h + 2 g) e + (k_mlp - 1) f + 2 d)

    (the down projection's gradient is the block output's: on a stage's last block that is the gradient
    received from the next stage, a buffer that stays alive with it); the stage with the head adds the
    final norm's output ``r n d``, the fused loss's scalar gradient (4 bytes; ``chunked``: each chunk's
    logits' gradient, ``c N V / tp`` in all). The stage holding block 0 retains nothing: its input (token
    ids) needs no gradient, so its ``I`` runs nothing and its ``W`` the whole backward.

    ``input_backward``: what ``I`` holds beyond that at its largest, in the MLP's backward: the
    gradient of the element-wise product ``4 N f`` and the FP32 gradient arriving from the block above,
    ``4 N d`` (one block's backward working set, ``plan/memory.py::block_backward_temporary``, less the
    retained projection gradients and the weight gradient ``W`` makes), 0 on the first stage.

    Measured (FP32, Llama GQA, 2 gloo processes, torch 2.13, ``zero_bubble`` and ``zbv``: every
    ``I``'s growth and peak, action by action, under ``probes/step_memory.py::StoragePeak``) exact; the
    16-bit, tensor-parallel and MoE forms (an MoE block taken as its dense shape) are derived, not
    measured."""
    layers = model.n_layers if layers is None else layers
    if first_layer == 0:
        return 0, 0
    D = _dims(model, vocab_size, seq_len, micro_batch, compute_bytes, tp, "cpu", fsdp_mixed_precision)
    N, n, d, c = D.N, D.n, D.d, D.c
    block = D.r * 2 * n * d + c * N * ((D.h + 2 * D.g) * D.e + (D.k_mlp - 1) * D.f + 2 * d)
    retained = layers * block
    if first_layer + layers == model.n_layers:
        retained += D.r * n * d + (c * N * D.V // tp if loss == "chunked" else 4)
    return retained, 4 * N * D.f + 4 * N * d
