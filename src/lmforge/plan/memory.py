"""Bytes of model state per device: parameters, gradients, master weights, optimizer states, and the
temporary buffers of each layout. Pure formulas over parameter *shapes*; nothing is allocated.

Parameters. :func:`param_tensors` lists every parameter of lmforge's ``Transformer`` for a
:class:`ModelConfig` (name, shape, which FSDP2 unit holds it, which dimension tensor parallelism splits),
in ``named_parameters`` order, tied weights once. Per block (``d`` width, ``h`` head dim, ``H`` / ``K``
query / key-value heads, ``f`` MLP width)::

    attention  d*H*h + 2*d*K*h + H*h*d      (+ H*h + 2*K*h + d biases)
    MLP        llama 3*d*f (gate, up, down); gpt2 2*d*f (+ f + d biases)
    norms      2*d (RMSNorm; LayerNorm with biases 4*d)

plus the embedding ``V*d``, gpt2's positions ``T*d``, the final norm and an untied head ``V*d``.

Two accountings of the model states (bytes per parameter, ``P`` parameters, ``N`` data-parallel ranks
that shard, ``K`` the optimizer's state bytes per parameter, 8 for Adam):

``lmforge`` (what lmforge allocates): FP32 parameters, which *are* the master weights (no separate copy;
``bf16`` autocasts, FSDP2 gathers BF16 copies), FP32 gradients, FP32 optimizer states (plus their step
counters, 8-bit code books and scales, Adafactor's factored rows and columns, exactly as torch keeps
them). Per device::

    DDP          4P + 4P + KP
    ZeRO-1       4P + 4P + KP/N          (DDP + ZeroRedundancyOptimizer: whole tensors per rank)
    ZeRO-2, -3   (4P + 4P + KP)/N        (FSDP2: sharded parameters, gradients and states)

``zero-paper`` (Rajbhandari et al. 2020, "ZeRO", section 3; Megatron-LM and DeepSpeed count the same):
16-bit parameters and gradients, FP32 master weights, FP32 states::

    DDP          2P + 2P + 4P + KP       (16P for Adam)
    ZeRO-1       2P + 2P + (4 + K)P/N    (4P + 12P/N)
    ZeRO-2       2P + (2 + 4 + K)P/N     (2P + 14P/N)
    ZeRO-3       (2 + 2 + 4 + K)P/N      (16P/N)

Tensor parallelism divides each split tensor by ``tp`` (projections, embeddings, head; norms and
row-parallel biases are replicated), a pipeline rank holds only its stages' tensors.

The build (:func:`build_bytes`). lmforge builds the model on the meta device, applies every
transformation there, then each rank allocates its own part of every parameter and initialises it as one
process would (``parallel/materialize.py``): for each parameter of the *whole* model's initialisation
plan, in order, a parameter the rank holds as a DTensor (FSDP2, tensor parallelism) or does not hold at
all but whose initialisation draws random numbers (another pipeline stage's weights) is drawn whole into
an FP32 temporary, the rank's cut is taken and copied into its shard, and the temporary is freed; a
parameter held whole as a plain tensor is initialised in place. Peak of a rank::

    FSDP2 / TP (any pipeline)   4 * (its FP32 shards) + max over those parameters of 4 * (whole + cuts)
    pipeline stage, plain       4 * (its parameters)  + 4 * (the largest drawn parameter of other stages)
    one process, DDP, ZeRO-1    4P (the whole replica, in place)  + DDP's buckets 4P (allocated when DDP
                                wraps the replica; ``gradient_as_bucket_view`` off)

``cuts``: ``distribute_tensor(..., src_data_rank=None)`` clones the rank's piece at each sharded mesh
dimension (data-parallel shard first, then tensor-parallel), so a parameter held in pieces briefly costs
its whole size plus those pieces (:func:`init_temporary`; with FSDP2 over a tensor-parallel dim-0 shard,
twice its whole size). Measured by PyTorch's ``MemTracker`` on 2 and 4 CPU processes
(``tests/test_estimate_build.py``): exact to the bytes, but for the RoPE tables (``2 * 4 T e``, counted
beside the step's parameters, not here) and a few scalars.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lmforge.config import ModelConfig
from lmforge.model.fused_loss import chunk_bytes, precomputes
from lmforge.model.transformer import ff_width, uses_bias
from lmforge.plan.activations import LOSSES

ACCOUNTINGS = ("lmforge", "zero-paper")
OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "adamw8bit", "muon", "soap")
SOAP_MAX_DIM = 10000  # SOAP's default optim.soap.max_precond_dim; another value rides in the key: "soap<=N"
QUANT_BLOCK = 256  # values per 8-bit block (torchao / bitsandbytes)
QUANT_MIN = 4096  # torchao quantises tensors of at least this many values (and whole blocks)
QMAP_BYTES = 256 * 4  # each 8-bit moment keeps its own FP32 code book of 256 entries
STEP_BYTES = 4  # a per-tensor FP32 step counter (torch's Adam/AdamW/Adafactor, torchao)


@dataclass(frozen=True)
class ParamTensor:
    """One parameter: ``unit`` is the FSDP2 unit holding it (``root``: embedding, positions, final
    norm, a tied head; ``block``; ``head``: an untied head; ``experts``: none, a routed expert weight
    under expert parallelism, :func:`expert_parallel`), ``layer`` its block (None outside blocks),
    ``tp_dim`` the dimension tensor parallelism splits (None: replicated), ``linear`` whether it is an
    ``nn.Linear`` weight (autocast casts those), ``muon`` whether Muon moves it (2-D, inside a block)."""

    name: str
    shape: tuple[int, ...]
    unit: str
    layer: int | None = None
    tp_dim: int | None = None
    linear: bool = False
    expert: bool = (
        False  # a routed experts' 3-D weight ``[E, d_in, d_out]`` (expert parallelism splits dim 0)
    )
    ep: int = (
        1  # expert parallelism: dim 0 split over ``ep`` ranks, held outside FSDP2 and DDP (unit ``experts``)
    )

    @property
    def numel(self) -> int:
        """``prod(shape)``."""
        return math.prod(self.shape)

    @property
    def muon(self) -> bool:
        """Muon moves 2-D matrices inside blocks (``optim/build.py::muon_routed``)."""
        return self.layer is not None and len(self.shape) == 2


def _block(cfg: ModelConfig, i: int) -> list[ParamTensor]:
    d, bias = cfg.d_model, uses_bias(cfg)
    head_dim = d // cfg.n_heads
    q, kv, f = cfg.n_heads * head_dim, (cfg.n_kv_heads or cfg.n_heads) * head_dim, ff_width(cfg)
    pre = f"blocks.{i}."
    out: list[ParamTensor] = []

    def linear(name: str, d_in: int, d_out: int, column: bool) -> None:
        # column-parallel: output rows split (weight dim 0, bias split); row-parallel: input split, bias replicated
        out.append(ParamTensor(pre + name + ".weight", (d_out, d_in), "block", i, 0 if column else 1, True))
        if bias:
            out.append(ParamTensor(pre + name + ".bias", (d_out,), "block", i, 0 if column else None))

    def norm(name: str) -> None:
        out.append(ParamTensor(pre + name + ".weight", (d,), "block", i))
        if cfg.arch == "gpt2" and bias:
            out.append(ParamTensor(pre + name + ".bias", (d,), "block", i))

    norm("attn_norm")
    linear("attn.q_proj", d, q, True)
    linear("attn.k_proj", d, kv, True)
    linear("attn.v_proj", d, kv, True)
    linear("attn.o_proj", q, d, False)
    norm("mlp_norm")
    if cfg.moe.is_moe_block(i):
        return out + _moe_mlp(cfg, i)
    if cfg.arch == "llama":
        linear("mlp.gate_proj", d, f, True)
        linear("mlp.up_proj", d, f, True)
        linear("mlp.down_proj", f, d, False)
    else:
        linear("mlp.fc_in", d, f, True)
        linear("mlp.fc_out", f, d, False)
    return out


def expert_width(cfg: ModelConfig) -> int:
    """``f_e``: one expert's hidden width, ``model.moe.d_expert`` or the dense MLP's."""
    return cfg.moe.d_expert or ff_width(cfg)


def _moe_mlp(cfg: ModelConfig, i: int) -> list[ParamTensor]:
    """An MoE block's feed-forward (``model/moe.py::MoE``), in ``named_parameters`` order: the router
    ``E x d`` (FP32 logits, never cast by autocast), the routed experts' ``gate_proj`` and ``up_proj``
    ``[E, d, f_e]`` and ``down_proj`` ``[E, f_e, d]``, and the shared experts' SwiGLU of ``s f_e`` hidden
    units (``s = shared_experts``; three ``nn.Linear`` weights). Under tensor parallelism
    (``parallel/tensor.py::_moe_plan``) the router and the routed experts are replicated (no ``tp_dim``)
    and the shared experts split like a dense MLP (``gate_proj`` / ``up_proj`` by rows, ``down_proj`` by
    columns)."""
    d, e, f = cfg.d_model, cfg.moe.experts, expert_width(cfg)
    pre = f"blocks.{i}.mlp."
    out = [ParamTensor(pre + "router.weight", (e, d), "block", i)]
    for name, shape in (("gate_proj", (e, d, f)), ("up_proj", (e, d, f)), ("down_proj", (e, f, d))):
        out.append(ParamTensor(pre + "experts." + name, shape, "block", i, expert=True))
    if cfg.moe.shared_experts:
        fs = cfg.moe.shared_experts * f
        for name, shape, cut in (
            ("gate_proj", (fs, d), 0),
            ("up_proj", (fs, d), 0),
            ("down_proj", (d, fs), 1),
        ):
            out.append(ParamTensor(pre + "shared." + name + ".weight", shape, "block", i, cut, linear=True))
    return out


def moe_blocks(cfg: ModelConfig) -> list[int]:
    """The indices of the MoE blocks (``MoEConfig.is_moe_block``: ``i >= first_dense`` and
    ``(i - first_dense) % every == 0``); none without experts."""
    return [i for i in range(cfg.n_layers) if cfg.moe.is_moe_block(i)]


def active_param_count(cfg: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """Parameters one token uses: :func:`param_count` less, in each MoE block, the routed experts it is
    not sent to, ``(E - k) * 3 d f_e`` (``E`` experts, ``k = top_k``; the router and the shared experts
    are used by every token). Equal to :func:`param_count` for a dense model. Capacity drops are not
    counted (a dropped assignment runs with weight 0 in lmforge, so it is computed all the same)."""
    m = cfg.moe
    idle = (m.experts - m.top_k) * 3 * cfg.d_model * expert_width(cfg) if m.experts else 0
    return param_count(cfg, vocab_size, seq_len) - idle * len(moe_blocks(cfg))


def param_tensors(cfg: ModelConfig, vocab_size: int, seq_len: int) -> list[ParamTensor]:
    """Every parameter of ``Transformer(cfg, vocab_size, seq_len)``, in ``named_parameters`` order."""
    d = cfg.d_model
    tied = cfg.tie_embeddings
    out = [ParamTensor("embed.weight", (vocab_size, d), "root", tp_dim=0, linear=tied)]
    if cfg.arch == "gpt2":
        out.append(ParamTensor("pos_embed.weight", (seq_len, d), "root", tp_dim=0))
    for i in range(cfg.n_layers):
        out += _block(cfg, i)
    out.append(ParamTensor("norm.weight", (d,), "root"))
    if cfg.arch == "gpt2" and uses_bias(cfg):
        out.append(ParamTensor("norm.bias", (d,), "root"))
    if not tied:
        out.append(ParamTensor("lm_head.weight", (vocab_size, d), "head", tp_dim=0, linear=True))
    return out


def draws(t: ParamTensor) -> bool:
    """Whether initialising ``t`` draws random numbers: linear and embedding weights ~ N(0, std^2) (the
    2-D tensors here); biases and norm weights are constants (``model/init.py::init_plan``)."""
    return len(t.shape) >= 2


def param_count(cfg: ModelConfig, vocab_size: int, seq_len: int) -> int:
    """``N``: parameters of the model, tied ones once (the sum of :func:`param_tensors`)."""
    return sum(t.numel for t in param_tensors(cfg, vocab_size, seq_len))


def model_buffer_bytes(cfg: ModelConfig, seq_len: int) -> int:
    """The model's buffers, held whole by every rank (a pipeline stage too) beside its parameters: Llama's
    RoPE tables, cos and sin, FP32, ``2 * 4 * T * e`` (``T`` the sequence length, ``e`` the head
    dimension; ``model/transformer.py::reset_buffers``); GPT-2 has none; plus :func:`moe_buffer_bytes`."""
    rope = 2 * 4 * seq_len * (cfg.d_model // cfg.n_heads) if cfg.arch == "llama" else 0
    return rope + moe_buffer_bytes(cfg)


def moe_buffer_bytes(cfg: ModelConfig) -> int:
    """Each MoE layer's FP32 buffers (``model/moe.py::MoE``): the balancing bias and the step's load per
    expert, and six counters, ``4 (2 E + 6)``; every rank holds them whole."""
    return 4 * (2 * cfg.moe.experts + 6) * len(moe_blocks(cfg))


def split(n: int, parts: int) -> int:
    """The largest piece of ``n`` cut in ``parts`` as torch's ``Shard`` cuts: ``ceil(n / parts)``."""
    return -(-n // parts)


def expert_parallel(tensors: list[ParamTensor], ep: int) -> list[ParamTensor]:
    """``tensors`` as a rank holds them under ``parallel.ep = ep`` (``parallel/expert.py``): each routed
    experts' weight split on dim 0 over ``ep`` ranks (``E / ep`` whole experts of every MoE layer, a
    plain local tensor of a DTensor), kept out of FSDP2 and DDP (unit ``experts``), so replicated over the
    ``dp / ep`` ranks holding the same experts, never sharded further; the dense parts (attention, norms,
    embedding, head, the router, the shared experts) unchanged, following the layout's dense rules."""
    if ep == 1:
        return tensors
    return [replace(t, unit="experts", ep=ep) if t.expert else t for t in tensors]


def data_parallel(t: ParamTensor) -> bool:
    """Whether FSDP2 or DDP holds ``t`` (every parameter but the experts under expert parallelism)."""
    return t.unit != "experts"


def tp_shape(t: ParamTensor, tp: int) -> tuple[int, ...]:
    """Shape of ``t`` on the largest tensor-parallel rank (and expert-parallel rank: an expert weight
    under ``parallel.ep`` is cut on dim 0, :func:`expert_parallel`)."""
    if t.ep > 1:
        return (split(t.shape[0], t.ep), *t.shape[1:])
    if tp == 1 or t.tp_dim is None:
        return t.shape
    return tuple(split(s, tp) if i == t.tp_dim else s for i, s in enumerate(t.shape))


def fsdp_shape(shape: tuple[int, ...], shards: int) -> tuple[int, ...]:
    """FSDP2's largest local shard: dim 0 cut in ``shards`` pieces (``Shard(0)``, padded)."""
    if shards == 1:
        return shape
    return (split(shape[0], shards), *shape[1:])


def stage_tensors(tensors: list[ParamTensor], layers: range, n_layers: int) -> list[ParamTensor]:
    """What a pipeline rank owning blocks ``layers`` keeps (``model.transformer.keep_stage``): its blocks,
    the embedding (and positions) with block 0, the final norm and head with the last block. A tied head
    on a last stage that lacks block 0 keeps its own copy of the embedding matrix."""
    first, last = layers.start == 0, layers.stop == n_layers
    out = []
    for t in tensors:
        if t.layer is not None:
            keep = t.layer in layers
        elif t.name in ("embed.weight", "pos_embed.weight"):
            keep = first or (last and t.name == "embed.weight" and t.linear)
        else:
            keep = last
        if keep:
            out.append(t)
    return out


def optimizer_state_bytes(
    optimizer: str, local: tuple[int, ...], whole: tuple[int, ...], muon: bool, counters: bool = True
) -> int:
    """State bytes one rank keeps for a parameter of shape ``whole`` held as ``local`` (its shard).

    ``adamw`` / ``adam``: two FP32 moments ``8n`` (+ a 4-byte step); ``sgd`` with momentum: ``4n``
    (``sgd0``: none); ``lion``: ``4n``; ``adafactor``: a row and a column FP32 mean of the *whole* matrix
    ``4(prod(shape[:-1]) + prod(shape[:-2]) * shape[-1])`` on every rank (``4n`` for vectors; + step);
    ``adamw8bit``: per moment ``n`` codes + ``4n/256`` scales + a 1,024-byte code book where the whole
    tensor has at least 4,096 values in whole blocks of 256, else ``4n`` (+ step); ``muon``: ``4n``
    momentum for block matrices, AdamW's ``8n`` + step for the rest; ``soap`` (key :func:`optimizer_key`):
    AdamW's ``8n`` + step, and for a 2-D tensor ``(m, n)`` a factor and a basis of each side whose
    dimension is at most ``max_precond_dim``, whole on every rank that holds a piece: ``8m^2`` and/or
    ``8n^2`` (FP32; ``optim/soap.py``). ``counters=False`` leaves out the step counters and code books
    (the per-parameter convention of the ZeRO paper).
    """
    n = math.prod(local)
    step = STEP_BYTES if counters else 0
    if optimizer.startswith("soap"):
        sides = soap_sides(whole, soap_max_dim(optimizer))
        return 8 * n + step + sum(8 * d * d for d, on in zip(whole, sides, strict=False) if on)
    if optimizer in ("adamw", "adam") or (optimizer == "muon" and not muon):
        return 8 * n + step
    if optimizer in ("sgd", "lion") or optimizer == "muon":
        return 4 * n
    if optimizer == "sgd0":
        return 0
    if optimizer == "adafactor":
        if len(whole) < 2:
            return 4 * math.prod(whole) + step
        rows = math.prod(whole[:-1])
        cols = math.prod(whole[:-2]) * whole[-1]
        return 4 * (rows + cols) + step
    if optimizer == "adamw8bit":
        total = math.prod(whole)
        if total >= QUANT_MIN and total % QUANT_BLOCK == 0 and _blocks_align(local, whole):
            moment = n + 4 * (n // QUANT_BLOCK) + (QMAP_BYTES if counters else 0)
        else:
            moment = 4 * n
        return 2 * moment + step
    raise ValueError(f"optim.name: no state size for {optimizer!r}; known: {', '.join(OPTIMIZERS)}")


def _blocks_align(local: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    """Whether a dim-0 shard ``local`` of ``whole`` cuts into blocks of the whole tensor (else AdamW8bit
    keeps FP32 moments for it; ``optim/adamw8bit.py::blocks_align``): whole blocks after dim 0, or an even
    split into whole blocks. Shards of other dimensions (row-parallel TP) are taken as aligned."""
    if local == whole or local[0] == whole[0]:
        return True
    return math.prod(whole[1:]) % QUANT_BLOCK == 0 or (
        whole[0] % local[0] == 0 and math.prod(local) % QUANT_BLOCK == 0
    )


def optimizer_key(name: str, sgd_momentum: float = 0.9, soap_max_dim: int = SOAP_MAX_DIM) -> str:
    """The state-size key of an optimizer config: ``sgd`` without momentum keeps no state (``sgd0``);
    ``soap`` with another ``max_precond_dim`` than 10,000 carries it: ``soap<=N``."""
    if name == "soap" and soap_max_dim != SOAP_MAX_DIM:
        return f"soap<={soap_max_dim}"
    return "sgd0" if name == "sgd" and sgd_momentum == 0 else name


def soap_max_dim(key: str) -> int:
    """``max_precond_dim`` of a SOAP key (``soap``: 10,000; ``soap<=N``: N)."""
    return int(key.removeprefix("soap<=")) if key.startswith("soap<=") else SOAP_MAX_DIM


def soap_sides(shape: tuple[int, ...], max_dim: int) -> tuple[bool, bool]:
    """Which sides of a tensor SOAP gives a factor and a basis (``optim/soap.py::preconditioned_sides``):
    a 2-D tensor's sides of at most ``max_dim``; none for other tensors."""
    if len(shape) != 2:
        return False, False
    return shape[0] <= max_dim, shape[1] <= max_dim


def state_bytes_per_param(optimizer: str) -> float:
    """``K``: optimizer-state bytes per parameter by the per-parameter convention (no counters, dense
    tensors): adam(w) 8, sgd 4 (0 without momentum), lion 4, muon 4 (its matrices), adamw8bit
    2 + 8/256 (codes and block scales), adafactor ~0 (factored: rows + columns of each matrix), soap 8
    (its two moments; each matrix's factors and bases, ``8(m^2 + n^2)``, are not per parameter)."""
    if optimizer.startswith("soap"):
        return 8.0
    return {"adamw": 8, "adam": 8, "sgd": 4, "sgd0": 0, "lion": 4, "muon": 4, "adamw8bit": 2 + 8 / 256}.get(
        optimizer, 0.0
    )


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one device."""

    params: float
    grads: float
    master: float
    optim: float

    @property
    def total(self) -> float:
        """``params + grads + master + optim``."""
        return self.params + self.grads + self.master + self.optim


def per_param_formula(
    kind: str, p: float, n: int, k: float = 8, accounting: str = "zero-paper"
) -> StateBytes:
    """The model states of ``p`` parameters per device as the closed formulas of the module docstring:
    ``kind`` ``ddp`` | ``zero1`` | ``zero2`` | ``zero3`` over ``n`` ranks, ``k`` optimizer bytes per
    parameter (8: Adam). E.g. zero-paper ZeRO-1 = ``2p + 2p + (4 + k)p / n``."""
    if accounting == "lmforge":
        shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (n, n, n), "zero3": (n, n, n)}[kind]
        return StateBytes(4 * p / shard[0], 4 * p / shard[1], 0.0, k * p / shard[2])
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (1, n, n), "zero3": (n, n, n)}[kind]
    return StateBytes(2 * p / shard[0], 2 * p / shard[1], 4 * p / shard[2], k * p / shard[2])


def group_key(t: ParamTensor, optimizer: str) -> tuple[str, str]:
    """``(kind, route)`` of ``optim/build.py::param_groups`` (without layer-wise decay or muP): kind
    ``embedding`` (token and position tables), ``norm`` (norm weights), ``matrix`` (2-D and up) or
    ``bias``; route ``muon`` / ``adamw`` under Muon. lmforge's groups come sorted by this key."""
    if t.name in ("embed.weight", "pos_embed.weight"):
        kind = "embedding"
    elif t.name.endswith("norm.weight"):
        kind = "norm"
    else:
        kind = "matrix" if len(t.shape) >= 2 else "bias"
    route = ("muon" if kind == "matrix" and t.muon else "adamw") if optimizer == "muon" else ""
    return kind, route


def zero1_partition(tensors: list[ParamTensor], ranks: int, optimizer: str, tp: int = 1) -> list[list[int]]:
    """Indices of ``tensors`` each ZeRO-1 rank owns, as ``ZeroRedundancyOptimizer._partition_parameters``
    assigns them: group by group (lmforge's group order), each group's tensors largest first (stable),
    each to the rank with the fewest parameters so far (the first such rank), the count carried across
    groups."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(group_key(t, optimizer), []).append(i)
    sizes = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for key in sorted(groups):
        for i in sorted(groups[key], key=lambda i: -math.prod(tp_shape(tensors[i], tp))):
            rank = sizes.index(min(sizes))
            owned[rank].append(i)
            sizes[rank] += math.prod(tp_shape(tensors[i], tp))
    return owned


def model_states(
    tensors: list[ParamTensor],
    kind: str,
    shards: int,
    tp: int,
    optimizer: str,
    accounting: str = "lmforge",
) -> StateBytes:
    """Model-state bytes of one device holding ``tensors`` (one pipeline rank's), ``kind`` ``none`` |
    ``ddp`` | ``zero1`` | ``zero2`` | ``zero3`` with ``shards`` ranks sharding (``dp_shard``), ``tp``.

    Sharded tensors are counted at the largest rank's piece (``ceil``). ``lmforge``: 4 + 4 bytes of
    parameter and gradient, states by :func:`optimizer_state_bytes` with counters; ``zero-paper``: 2 + 2
    + 4 master + states without counters, sharded as in the ZeRO paper.
    """
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"--weights: {accounting!r}; use lmforge or zero-paper")
    fsdp = kind in ("zero2", "zero3")
    counters = accounting == "lmforge"
    params = grads = master = 0
    states = []
    for t in tensors:
        local = tp_shape(t, tp)
        shard = fsdp_shape(local, shards if fsdp and data_parallel(t) else 1)
        n_local, n_shard = math.prod(local), math.prod(shard)
        opt_shape = shard if fsdp else local
        states.append(optimizer_state_bytes(optimizer, opt_shape, t.shape, t.muon, counters))
        if accounting == "lmforge":
            params += 4 * n_shard
            grads += 4 * n_shard
        else:
            params += 2 * (n_shard if kind == "zero3" else n_local)
            grads += 2 * (n_shard if fsdp else n_local)
            master += 4 * n_shard  # whole unless FSDP shards it; ZeRO-1's below
    if kind == "zero1":  # the rank whose master weights and states are largest
        owned = zero1_partition(tensors, shards, optimizer, tp)
        masters = [4 * math.prod(tp_shape(t, tp)) if accounting == "zero-paper" else 0 for t in tensors]
        master, optim = max(
            ((sum(masters[i] for i in idx), sum(states[i] for i in idx)) for idx in owned), key=sum
        )
    else:
        optim = sum(states)
    return StateBytes(float(params), float(grads), float(master), float(optim))


@dataclass(frozen=True)
class BuildBytes:
    """Bytes of one device at the peak of the build (before any training step), lmforge accounting."""

    shards: float  # the rank's FP32 parameters: its shards, or its whole replica
    temporary: float  # the largest whole FP32 parameter drawn into a temporary, with its cuts
    ddp_buckets: float = 0.0  # DDP's flat gradient buckets, allocated when DDP wraps the replica

    @property
    def total(self) -> float:
        """``shards + temporary + ddp_buckets``."""
        return self.shards + self.temporary + self.ddp_buckets


def init_temporary(t: ParamTensor, tp: int, shards: int) -> int:
    """Values alive at once while a rank initialises ``t`` through a temporary: the whole parameter, plus
    the clones ``distribute_tensor(..., src_data_rank=None)`` makes of the rank's piece at each sharded
    mesh dimension, FSDP2's first (``shards`` ranks, dim 0), then tensor parallelism's; an expert weight
    under expert parallelism, ``whole + whole / ep``. Where both cut
    dim 0 (column-parallel weights, embeddings, the head), FSDP2's placement is a ``_StridedShard``,
    which first assembles every rank's piece (a whole copy) and clones this rank's: ``2 whole + whole /
    shards``. Else ``whole + whole / shards + whole / (shards tp)`` (each cut that applies). ``t.numel``
    when ``t`` is not cut (a replicated norm weight, another pipeline stage's parameter)."""
    whole = t.numel
    if t.ep > 1:
        return whole + math.prod(tp_shape(t, tp))
    fsdp_cut = math.prod(fsdp_shape(t.shape, shards)) if shards > 1 else 0
    if fsdp_cut and tp > 1 and t.tp_dim == 0:
        return 2 * whole + fsdp_cut
    tp_cut = math.prod(fsdp_shape(tp_shape(t, tp), shards)) if tp > 1 and t.tp_dim is not None else 0
    return whole + fsdp_cut + tp_cut


def build_bytes(
    whole: list[ParamTensor], mine: list[ParamTensor], kind: str, shards: int, tp: int
) -> BuildBytes:
    """The build's peak on a rank holding ``mine`` (one pipeline rank's tensors) of the model ``whole``,
    ``kind`` ``none`` | ``ddp`` | ``zero1`` | ``zero2`` | ``zero3`` over ``shards`` sharding ranks and
    ``tp`` (module docstring): the rank's FP32 parameters (FSDP2 shards at the largest rank's piece,
    ``ceil``), the largest temporary of :func:`init_temporary` over the parameters the rank holds as
    DTensors (FSDP2 or TP) and the drawn parameters it does not hold, and DDP's buckets (DDP and ZeRO-1).
    """
    fsdp = kind in ("zero2", "zero3")
    held = {t.name: t for t in mine}
    dtensor = fsdp or tp > 1
    n = shards if fsdp else 1
    local = sum(math.prod(fsdp_shape(tp_shape(t, tp), n if data_parallel(t) else 1)) for t in mine)
    via_temporary = [
        held.get(t.name, t)
        for t in whole
        if (t.name in held and (dtensor or held[t.name].ep > 1)) or (t.name not in held and draws(t))
    ]
    temporary = max(
        (init_temporary(t, tp, n) if t.name in held else t.numel for t in via_temporary), default=0
    )
    ddp = kind in ("ddp", "zero1")
    buckets = 4 * sum(math.prod(tp_shape(t, tp)) for t in mine if data_parallel(t)) if ddp else 0
    return BuildBytes(4.0 * local, 4.0 * temporary, float(buckets))


def compute_bytes(number_format: str) -> int:
    """Bytes of a value in the matmuls' dtype: 2 for bf16 / fp16 / fp8 (FP8 layers keep BF16 weights
    outside the matmul), 4 for fp32 / tf32."""
    return 2 if number_format in ("bf16", "fp16", "fp8") else 4


@dataclass(frozen=True)
class Temporaries:
    """Buffers beside the model states and the saved activations (bytes, one device). Autocast's 16-bit
    weight copies are not here: the matmuls save them, so ``plan/activations.py`` counts them. Which of
    them are alive in which phase of the step is ``plan/estimate.py::step_phases``'s business."""

    fsdp_gathered: float = 0.0  # unsharded parameter copies FSDP2 holds at their most (a block's backward)
    fsdp_grad_reduce: float = 0.0  # one unit's unsharded gradient and its FP32 reduce copy
    ddp_buckets: float = 0.0  # DDP's flat gradient buckets (gradient_as_bucket_view=False)
    loss_chunk: float = 0.0  # the loss's own buffers at their largest (loss_temporary)
    optimizer_step: float = 0.0  # the optimizer step's own scratch (after backward)
    fsdp_root: float = 0.0  # FSDP2: the root unit's gathered copy (kept from forward to backward)
    fsdp_head: float = 0.0  # FSDP2: an untied head's gathered copy (its own unit)
    fsdp_unit: float = 0.0  # FSDP2: the largest block unit's gathered copy
    loss_forward: float = 0.0  # the loss's buffers in its forward (loss_phases)
    loss_backward: float = 0.0  # the loss's buffers in its backward (loss_phases)
    block_backward: float = 0.0  # one block's backward working set (block_backward_temporary)
    tied_grads: float = 0.0  # a tied embedding's extra gradient copies at the end of backward

    @property
    def during_backward(self) -> float:
        """The sum of the buffers that can coexist with the activations (everything but the optimizer
        step's scratch and the end of backward's tied copies), an upper bound of any phase's."""
        return self.fsdp_gathered + self.fsdp_grad_reduce + self.ddp_buckets + self.loss_chunk


def loss_phases(
    loss: str,
    chunk_tokens: int,
    vocab_size: int,
    tp: int,
    c: int,
    tokens: int = 0,
    d_model: int = 0,
    fsdp: bool = False,
) -> tuple[int, int]:
    """``(forward, backward)``: bytes the loss of one micro-batch of ``tokens`` tokens (``d_model`` wide)
    holds beyond what it keeps for backward, at their largest in its forward and in its backward,
    computed ``chunk_tokens`` at a time.

    ``fused`` (``model/fused_loss.py``; ``v = V / tp``, this rank's vocabulary rows; eager kernels): under
    autocast forward and backward each make the compute-dtype copies of the hidden states and of the
    head, ``casts = c (N d + v d)`` (under FSDP2, ``fsdp``, the gathered head already is in ``c`` bytes:
    ``c N d``). Computing a chunk's statistics holds its FP32 logits and their shifted exponentials,
    ``stats = 8 * chunk * v`` in either precision (FP32 by design: BF16 runs measure the same 8 bytes per
    logit as FP32 ones); its gradient ``model/fused_loss.py::chunk_bytes``. Recomputing (``precomputes``
    false): forward ``casts + stats``, backward ``casts + 4 (N d + v d) + chunk_bytes`` (the FP32
    gradients and a chunk's). Precomputing: forward ``casts + max(stats, chunk_bytes)`` (the gradients it
    fills are kept: activations), backward ``casts + 4 (N d + v d)``, the scaled copies of the gradients
    (under FSDP2 and autocast plus the head gradient's ``c``-byte copy, ``c v d``). Read from the code;
    within 5% of PyTorch's ``MemTracker`` on CPU (``tests/test_fused_loss.py``). ``chunked`` (a head
    then ``F.cross_entropy`` per chunk): the chunk's logits in ``c`` bytes and their FP32 copy
    (``.float()`` before the softmax), all-gathered over the vocabulary under TP: ``(c + 4) * chunk * V``,
    in forward and backward alike.
    """
    if loss == "fused":
        v, autocast = split(vocab_size, tp), c < 4
        casts = c * tokens * d_model + (0 if fsdp else c * v * d_model) if autocast else 0
        stats = 8 * chunk_tokens * v
        grads = 4 * (tokens * d_model + v * d_model)
        if precomputes(tokens, v, d_model, chunk_tokens, c):
            forward = max(stats, chunk_bytes(chunk_tokens, v, d_model, c))
            backward = grads + (c * v * d_model if fsdp and autocast else 0)
        else:
            forward, backward = stats, grads + chunk_bytes(chunk_tokens, v, d_model, c)
        return casts + forward, casts + backward
    if loss == "chunked":
        both = (c + 4) * chunk_tokens * vocab_size
        return both, both
    raise ValueError(f"loss {loss!r}: use one of {', '.join(LOSSES)}")


def loss_temporary(
    loss: str,
    chunk_tokens: int,
    vocab_size: int,
    tp: int,
    c: int,
    tokens: int = 0,
    d_model: int = 0,
    fsdp: bool = False,
) -> int:
    """The loss's buffers at their largest: the larger of :func:`loss_phases`' forward and backward."""
    return max(loss_phases(loss, chunk_tokens, vocab_size, tp, c, tokens, d_model, fsdp))


def block_backward_temporary(tensors: list[ParamTensor], tp: int, c: int, tokens: int, top_k: int = 0) -> int:
    """Bytes one block's backward holds beyond the saved activations still alive, at its largest: in the
    MLP's, whose buffers outgrow attention's at lmforge's shapes (``f`` its width on this rank, ``k`` its
    input projections: 2 for SwiGLU, 1 for GELU, ``N`` the micro-batch's tokens)::

        FP32            4 (k + 1) N f + 4 N d + 4 f d
        16-bit compute  2 (k + 2) N f + 4 N d + 4 f d

    the gradients of the hidden states and of the element-wise ops' inputs (with 16-bit compute some
    also in FP32, where autocast's matmul backward meets them), the FP32 gradient arriving from the block
    above and the output projection's FP32 weight gradient, less that projection's saved ``c``-byte input
    (freed by then: the figures above are net of it). Fitted to PyTorch's ``MemTracker`` on CPU (llama
    and gpt2, FP32 and BF16 autocast, one process and FSDP2: ``tests/test_estimate_phases.py``); 0
    without a block.

    An MoE block (``top_k = k``, ``R = N k`` routed rows, ``E_l`` experts of width ``f_e`` on this rank),
    fitted, not derived, to ``MemTracker``'s peak in the first block's backward of four one-process runs
    (4 and 8 experts, top-1 and top-2, FP32 and BF16, full checkpointing, 256 tokens 64 wide;
    ``tests/test_moe_plan.py``), net of the saved tensors the experts' backward has freed by then, as the
    dense figures are::

        FP32            4 R (f_e + d) + 4 N d + 4 E_l f_e d   (the last: the experts' down_proj gradient)
        16-bit compute  2 R (f_e + d) + 4 N d

    The larger of the dense and the MoE blocks' is taken."""
    return max(_dense_block_backward(tensors, tp, c, tokens), _moe_block_backward(tensors, c, tokens, top_k))


def _moe_block_backward(tensors: list[ParamTensor], c: int, tokens: int, top_k: int) -> int:
    """:func:`block_backward_temporary` of an MoE block (0 without one)."""
    down = next((t for t in tensors if t.expert and t.name.endswith("experts.down_proj")), None)
    if down is None or not tokens or not top_k:
        return 0
    e, f, d = tp_shape(down, 1)
    rows = tokens * top_k
    if c >= 4:
        return 4 * rows * (f + d) + 4 * tokens * d + 4 * e * f * d
    return 2 * rows * (f + d) + 4 * tokens * d


def _dense_block_backward(tensors: list[ParamTensor], tp: int, c: int, tokens: int) -> int:
    """:func:`block_backward_temporary` of a dense block (0 without one)."""
    down = next((t for t in tensors if t.name.endswith(("mlp.down_proj.weight", "mlp.fc_out.weight"))), None)
    if down is None or not tokens:
        return 0
    d, f = down.shape[0], math.prod(tp_shape(down, tp)) // down.shape[0]
    k = 2 if down.name.endswith("down_proj.weight") else 1
    per_f = 4 * (k + 1) if c >= 4 else 2 * (k + 2)
    return per_f * tokens * f + 4 * tokens * d + 4 * f * d


def temporaries(
    tensors: list[ParamTensor],
    kind: str,
    shards: int,
    tp: int,
    number_format: str,
    optimizer: str,
    vocab_size: int,
    loss_tokens: int,
    accounting: str = "lmforge",
    loss: str = "fused",
    pipeline: bool = False,
    tokens: int = 0,
    nesterov: bool | None = None,
    weight_decay: bool = True,
    top_k: int = 0,
) -> Temporaries:
    """Temporary buffers of one device (``c`` compute bytes, ``g`` gradient bytes: 4, or 2 in zero-paper):

    * ZeRO-2 (FSDP2, ``reshard_after_forward=False``): every parameter gathered from forward to backward,
      ``c * P_local`` (and, with several micro-batches, through all of them until the last backward);
      ZeRO-3: the root unit (embedding, positions, final norm, tied head: lmforge keeps it gathered from
      forward to backward) plus two of the largest unit (the one computing and the one prefetched),
      ``c``-byte copies; ZeRO-3 on a pipeline stage (``pipeline``): as ZeRO-2, since the schedule keeps each
      unit gathered after its backward until the step's gradients are reduced (torch's
      ``set_reshard_after_backward(False)``), so every unit of the stage is gathered at the end of a
      backward; either: one unit's unsharded gradient for its reduce-scatter in ``c`` bytes and, when
      ``c`` is 2, its FP32 copy (``reduce_dtype``): ``(c + 4 [c < 4]) * unit``;
    * DDP and ZeRO-1 (lmforge's DDP defaults: 25 MiB buckets, ``gradient_as_bucket_view=False``): flat
      bucket copies of every gradient, ``g * P``;
    * the loss: :func:`loss_phases` (``loss``: ``fused`` or ``chunked``) of a micro-batch of
      ``tokens`` tokens, ``loss_tokens`` at a time, in its forward and its backward;
    * FSDP2's gathered copies by unit (``c`` bytes): the root, an untied head, the largest block, which
      ``plan/estimate.py::step_phases`` counts phase by phase (the root and the head in the loss's
      forward; one block prefetched besides in the loss's backward; two blocks in the blocks' backward);
    * one block's backward working set, :func:`block_backward_temporary` (``top_k``: an MoE block's);
    * a tied embedding (on the rank holding the head): at the end of backward the head's ``V d``
      gradient, the embedding's and their sum coexist, ``g V d`` twice beyond the gradient row's one
      (``V d / tp`` on this rank); under FSDP2 the three are unsharded, which replaces the root's
      sharded ``g V d / N`` in the gradient row: ``g V d (3 - 1/N)``;
    * the optimizer step (after backward, apart from activations): :func:`step_scratch`, the scratch of
      :func:`optimizer_step_bytes` on the rank that steps the most (``nesterov``, ``weight_decay``: the
      optimizer's settings it depends on, lmforge's defaults unless given).
    """
    c = compute_bytes(number_format)
    local = [math.prod(tp_shape(t, tp)) if data_parallel(t) else 0 for t in tensors]
    fsdp = kind in ("zero2", "zero3")
    out: dict[str, float] = {}
    if fsdp:
        units: dict[str, int] = {}
        for t, n in zip(tensors, local, strict=True):
            if not data_parallel(t):
                continue
            key = "root" if t.unit == "root" else (f"block{t.layer}" if t.unit == "block" else "head")
            units[key] = units.get(key, 0) + n
        biggest = max((v for k, v in units.items() if k != "root"), default=0)
        block = max((v for k, v in units.items() if k.startswith("block")), default=0)
        out["fsdp_root"], out["fsdp_head"], out["fsdp_unit"] = (
            c * units.get("root", 0),
            c * units.get("head", 0),
            c * block,
        )
        if kind == "zero2" or pipeline:
            out["fsdp_gathered"] = c * sum(local)
        else:
            out["fsdp_gathered"] = c * (units.get("root", 0) + 2 * biggest)
        out["fsdp_grad_reduce"] = (c + (4 if c < 4 else 0)) * biggest
    elif kind in ("ddp", "zero1"):
        out["ddp_buckets"] = (4 if accounting == "lmforge" else 2) * sum(local)
    has_head = any(t.name == "lm_head.weight" or (t.name == "embed.weight" and t.linear) for t in tensors)
    if has_head and loss_tokens:
        d = next(t.shape[1] for t in tensors if t.name in ("lm_head.weight", "embed.weight"))
        forward, backward = loss_phases(loss, loss_tokens, vocab_size, tp, c, tokens or loss_tokens, d, fsdp)
        out["loss_forward"], out["loss_backward"], out["loss_chunk"] = (
            forward,
            backward,
            max(forward, backward),
        )
    emb = next((t for t in tensors if t.name == "embed.weight" and t.linear), None)
    if emb is not None and has_head:  # tied: the head's gradient, the embedding's and their sum
        g, whole = (4 if accounting == "lmforge" else 2), math.prod(tp_shape(emb, tp))
        out["tied_grads"] = g * whole * (3 - 1 / shards if fsdp else 2)
    out["block_backward"] = block_backward_temporary(tensors, tp, c, tokens, top_k)
    out["optimizer_step"] = step_scratch(tensors, kind, shards, tp, optimizer, nesterov, weight_decay)
    return Temporaries(**out)


def step_scratch(
    tensors: list[ParamTensor],
    kind: str,
    shards: int,
    tp: int,
    optimizer: str,
    nesterov: bool | None = None,
    weight_decay: bool = True,
) -> int:
    """The optimizer step's scratch on the rank whose is largest (:func:`optimizer_step_bytes`): under
    FSDP2 (``zero2`` / ``zero3``) each rank steps its shards of every tensor; under ZeRO-1 each rank steps
    only the whole tensors it owns (:func:`zero1_partition`), grouped as the whole model's groups; else the
    rank steps all of ``tensors`` (its tensor-parallel pieces). Under FSDP2 or tensor parallelism the
    parameters are DTensors, which Adafactor and Muon gather whole."""
    sharded = kind in ("zero2", "zero3") or tp > 1
    n = shards if kind in ("zero2", "zero3") else 1
    local = [math.prod(fsdp_shape(tp_shape(t, tp), n if data_parallel(t) else 1)) for t in tensors]
    ranks = zero1_partition(tensors, shards, optimizer, tp) if kind == "zero1" else [range(len(tensors))]
    return max(
        (
            optimizer_step_bytes(
                [tensors[i] for i in idx], [local[i] for i in idx], optimizer, sharded, nesterov, weight_decay
            )
            for idx in ranks
        ),
        default=0,
    )


def optimizer_step_bytes(
    tensors: list[ParamTensor],
    local: list[int],
    optimizer: str,
    sharded: bool = False,
    nesterov: bool | None = None,
    weight_decay: bool = True,
) -> int:
    """Bytes an optimizer step allocates beyond the parameters, gradients and states, at its largest, on
    a rank that steps ``tensors``, holding ``local[i]`` values of each (its shard or piece); ``sharded``:
    the parameters are DTensors (FSDP2, tensor parallelism). ``nesterov`` (None: lmforge's default, off
    for SGD and on for Muon); ``weight_decay``: matrices decay (lmforge decays matrices only, by default).
    ``n`` a tensor's local values, ``N`` its whole values, a group one of lmforge's optimizer groups
    (:func:`group_key`, restricted to ``tensors``):

    * ``adamw`` / ``adam``: 0. lmforge takes the fused kernel (``fused=True`` on CPU and CUDA), which
      updates every tensor in place (``optim.fused = false`` is not modelled).
    * ``sgd`` (with or without momentum): torch's per-tensor loop on CPU copies the gradient once to add
      the decay and once more for Nesterov's look-ahead, both alive together:
      ``max 4 n ([decayed] + [nesterov])``.
    * ``lion``: the ``foreach`` interpolation ``c`` is one FP32 copy of the group being stepped, freed
      before the next group's: ``4 * max over groups of sum n``.
    * ``adafactor``: torch's ``foreach`` step makes one FP32 variance estimate per value of the group
      (the row/column means and norms beside it are vectors and scalars): ``4 * max group``. Sharded, each
      tensor is gathered whole, its gradient too, and stepped alone: ``12 * max N``.
    * ``adamw8bit``: torchao steps each tensor alone in FP32; eagerly, at its largest six FP32 tensors of
      its size are alive (the decayed parameter, the two moments dequantised and interpolated, the squared
      gradient, the denominator and its quotient), 8-bit or FP32 moments alike: ``24 * max n`` (eager;
      compiled, the step is fused: not measured).
    * ``muon``: one matrix at a time. Nesterov's look-ahead ``4n``, under sharding the update gathered
      whole ``4N``, then Newton-Schulz in BF16 on the whole matrix: the iterate and its successor
      ``2 * 2N`` and the ``r x r`` Gram matrix and its polynomial ``2 * 2 r^2``, ``r`` the smaller side:
      ``max over Muon's matrices of 4 n [nesterov] + 4 N [sharded] + 4 N + 4 r^2``. The AdamW half is
      fused: 0.
    * ``soap``: one tensor at a time, the largest of :func:`soap_step_bytes` (a step that refreshes the
      bases: the largest a run takes after its first; the first step's ``eigh`` needs less).

    Gradient clipping before the step (``optim/clip.py``) adds one scalar norm per tensor: left out.
    Measured by PyTorch's ``MemTracker`` around ``optimizer.step()`` on CPU, one process, ZeRO-1 and
    FSDP2 on 2 gloo processes (``tests/test_optimizer_step_memory.py``): exact but for a few scalars,
    and but for a race that is not planned: where the step gathers each matrix whole, gloo's worker
    thread frees a finished gather's tensors only once it gets the GIL, so on a loaded machine the
    previous matrix's gathered copy was seen to outlive its step (one more whole matrix, at times).
    """
    if not tensors:
        return 0
    if optimizer in ("adamw", "adam"):
        return 0
    if optimizer in ("sgd", "sgd0"):
        look_ahead = int(bool(nesterov))
        return max(
            4 * n * (int(weight_decay and group_key(t, optimizer)[0] == "matrix") + look_ahead)
            for t, n in zip(tensors, local, strict=True)
        )
    if optimizer == "adamw8bit":
        return 24 * max(local)
    if optimizer == "adafactor" and sharded:
        return 12 * max(t.numel for t in tensors)
    if optimizer in ("lion", "adafactor"):
        groups: dict[tuple[str, str], int] = {}
        for t, n in zip(tensors, local, strict=True):
            key = group_key(t, optimizer)
            groups[key] = groups.get(key, 0) + n
        return 4 * max(groups.values())
    if optimizer == "muon":
        look_ahead = 4 if nesterov is None or nesterov else 0
        return max(
            (
                look_ahead * n + 4 * t.numel * (2 if sharded else 1) + 4 * min(t.shape) ** 2
                for t, n in zip(tensors, local, strict=True)
                if t.muon
            ),
            default=0,
        )
    if optimizer.startswith("soap"):
        max_dim = soap_max_dim(optimizer)
        return max(
            soap_step_bytes(t.shape, n, soap_sides(t.shape, max_dim), sharded)
            for t, n in zip(tensors, local, strict=True)
        )
    raise ValueError(f"optim.name: no step scratch for {optimizer!r}; known: {', '.join(OPTIMIZERS)}")


def soap_step_bytes(shape: tuple[int, ...], n: int, sides: tuple[bool, bool], sharded: bool) -> int:
    """Scratch of SOAP's step (``optim/soap.py``) for one FP32 tensor of ``shape`` (``N`` values) held as
    ``n`` values here, with a factor on ``sides``, in a step that refreshes its bases. ``k`` sides, ``d``
    a side's dimension:

    * no side (vectors, 3-D, oversized matrices): the denominator ``sqrt(v_hat) + eps``, ``4n``;
    * plain: ``G G^T`` / ``G^T G`` before the factor's update, ``4 d^2``; the refresh: ``V`` permuted into a
      copy ``4N`` beside ``Q[:, order]``, ``F Q`` and QR's ``Q`` and ``R`` (``4 * 4 d^2``) and the order's
      int64 indices ``8d`` (with both sides, the second permutation's new copy beside the first, ``8N + 8d``);
      the rotations, each a product of ``N`` values beside its input: ``4 (1 + k) N`` (``QL^T M`` then
      ``. QR``, and ``N'`` with its rotation back);
    * sharded (DTensors: FSDP2, tensor parallelism): the whole gradient ``4N`` lives through the factors'
      updates and the refresh, and the refresh's first permutation takes ``V`` gathered whole, so the
      gathered and the permuted copy meet (``4N + 8N + 8d``); the rotations as above, with ``M`` and
      ``N'`` gathered whole as their inputs, and this rank's cut of ``N'`` (``4n``) beside the rotation
      back: ``4 (1 + k) N + 4n``.

    Measured by PyTorch's ``MemTracker`` (``tests/test_optimizer_step_memory.py``)."""
    if not any(sides):
        return 4 * n
    whole = math.prod(shape)
    dims = [d for d, on in zip(shape, sides, strict=True) if on]
    k = len(dims)
    factor = max(4 * d * d for d in dims)
    refresh = 4 * whole + max(16 * d * d + 8 * d for d in dims)
    if k == 2:
        refresh = max(refresh, 8 * whole + 8 * shape[1])
    rotate = 4 * (1 + k) * whole
    if not sharded:
        return max(factor, refresh, rotate)
    g, first = 4 * whole, dims[0]
    return max(g + factor, g + refresh, g + 8 * whole + 8 * first, rotate + 4 * n)


@dataclass(frozen=True)
class Overhead:
    """The framework's own memory: a fixed runtime part and a fraction of everything allocated."""

    runtime_bytes: float
    fragmentation: float
    note: str


GPU_OVERHEAD = Overhead(
    1.0 * 2**30,
    0.05,
    "CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers ~1 GiB (the context alone is 0.3-0.6 GiB on "
    "CUDA 12; NCCL adds a few hundred MiB per communicator), plus 5% of allocated bytes lost to the "
    "caching allocator's fragmentation (assumed; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
    "lowers it)",
)
CPU_OVERHEAD = Overhead(
    0.5 * 2**30,
    0.05,
    "the Python interpreter, torch and lmforge ~0.5 GiB resident (benchmarks/scaling.py measured 530-580 "
    "MiB per process for a 4M-parameter model), plus 5% of allocated bytes for the allocator (assumed)",
)


def deepspeed_zero2_gpu_bytes(total_params: float, gpus: int) -> float:
    """DeepSpeed's published estimate of ZeRO-2 model-state bytes per GPU without offload
    (``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``, ``cpu_offload=False``):
    ``4 P + int(16 P / gpus)``: 4 bytes per parameter on every GPU (16-bit parameters and 16-bit
    gradients of the whole model) and 16 sharded (FP32 master weights and Adam moments, 12, and 4 more
    the source does not break down: an FP32 gradient partition fits it)."""
    return 4 * total_params + int(16 * total_params / gpus)


def deepspeed_zero3_gpu_bytes(total_params: float, largest_layer_params: float, gpus: int) -> float:
    """DeepSpeed's published estimate of ZeRO-3 model-state bytes per GPU without offload
    (``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``, ``cpu_offload=False``):
    ``4 L + int(18 P / gpus)`` with ``L`` the largest layer's parameters (gathered 16-bit parameters and
    gradients of one layer) and 18 bytes per sharded parameter (the ZeRO paper's 16 and 2 more that the
    source does not break down)."""
    return 4 * largest_layer_params + int(18 * total_params / gpus)
