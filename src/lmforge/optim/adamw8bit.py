"""AdamW with block-wise 8-bit quantised moments (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), from ``torchao.optim.AdamW8bit``.

The update is AdamW's, computed in FP32 from the dequantised moments::

    m = lerp(deq(m_q), g, 1 - b1);  v = lerp(deq(v_q), g^2, 1 - b2);  m_q, v_q = q(m), q(v)
    p = p * (1 - lr * wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

``q`` stores one uint8 code per value (a dynamic-tree code book of 256 entries, signed for ``m``, unsigned
for ``v``) and one FP32 absmax scale per block of 256 values. torchao quantises only tensors of at least
4096 values whose size is a multiple of the block; smaller ones (norm weights, biases) keep FP32 moments.

Two adaptations to lmforge's loop, which is why this is a subclass and not torchao's class as is:

* the loop sets ``group["lr"]`` to a float each step; torchao wants a tensor (so that a new rate does not
  recompile its step), so floats are turned back into tensors before each step;
* torchao compiles its per-parameter step with ``torch.compile``; with ``compile=False`` (as with
  ``train.compile = false``, or without a C++ compiler on CPU) the same function runs eagerly;
* sharded parameters (``DTensor``: FSDP2, tensor parallelism): torchao quantises each rank's shard and
  decides by the shard's size, so a 64 x 64 matrix split over two ranks (2,048 values per shard) would
  keep FP32 moments there but 8-bit ones in one process. Here the decision is the whole tensor's, as in
  one process, and a shard is quantised when its blocks of 256 are blocks of the whole tensor (true for
  dim-0 shards of whole blocks, and whenever the values after the split dimension come in multiples of
  256): then every block has the same values, scale and codes as in one process, and the step is the
  same. A shard whose blocks would straddle the whole tensor's keeps FP32 moments (logged once per
  shape): exact AdamW there, not the one-process 8-bit rounding;
* ``state_dict`` gives the moments dequantised to FP32 (a ``DTensor`` placed like its parameter when
  sharded) and ``load_state_dict`` quantises them back: torchao's 8-bit tensor inside a ``DTensor`` does
  not gather correctly (``full_tensor`` and ``torch.distributed.checkpoint`` return wrong moments), and
  plain FP32 moments reshard to any layout. Loading recovers codes and scales that dequantise to exactly
  the saved values (a block's scale is its largest magnitude, or that over 0.99297 when the largest is
  negative: the signed code book ends at -0.99297), so a resume is exact; checkpoints hold 4 bytes per
  moment value instead of about 1.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

# Importing torchao (about 8 s; so lmforge imports this module only when adamw8bit is chosen) logs
# warnings about its prebuilt CUDA kernels (FP8 / CUTLASS) and a deprecation in its pytree registrations;
# neither concerns the 8-bit optimizer, which is plain PyTorch plus torch.compile, so they are muted here.
_NOISY = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
_levels = [log.level for log in _NOISY]
for _log in _NOISY:
    _log.setLevel(logging.ERROR)
try:
    from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import OptimState8bit
finally:
    for _log, _level in zip(_NOISY, _levels, strict=True):
        _log.setLevel(_level)


log = logging.getLogger(__name__)

_WARNED: set[tuple[int, ...]] = set()
MIN_QUANTISED = 4096  # torchao (after bitsandbytes) quantises tensors of at least this many values


def blocks_align(
    shape: tuple[int, ...], placements: tuple[Placement, ...], mesh_shape: tuple[int, ...], block: int
) -> bool:
    """Whether each shard of a tensor of ``shape`` split by ``placements`` over a mesh of ``mesh_shape``,
    read in its own memory order, cuts into blocks of ``block`` values that are blocks of the whole tensor
    (so that block-wise quantisation groups the same values as in one process).

    A shard is a run of ``l * T`` values for each index it holds of the dimensions before ``k``, with ``k``
    the last split dimension, ``T`` the number of values after it and ``l`` its extent of ``k``. True when
    ``T`` is a multiple of ``block``; else when ``k`` is split evenly (plain ``Shard`` only) into pieces
    whose ``l * T`` is, and, unless ``k = 0``, one index of the dimensions before ``k`` spans whole blocks.
    Conservative: false for layouts it does not follow (``_StridedShard`` on ``k`` with ``T`` not whole).
    """
    # every split placement (Shard, _StridedShard) has a dim; Replicate has none
    split = [(n, pl) for n, pl in zip(mesh_shape, placements, strict=True) if hasattr(pl, "dim") and n > 1]
    if not split:
        return True
    k = max(pl.dim % len(shape) for _, pl in split)
    after = math.prod(shape[k + 1 :])
    if after % block == 0:
        return True
    on_k = [(n, pl) for n, pl in split if pl.dim % len(shape) == k]
    if not all(type(pl) is Shard for _, pl in on_k):
        return False
    pieces = math.prod(n for n, _ in on_k)
    if shape[k] % pieces:
        return False
    return (shape[k] // pieces * after) % block == 0 and (k == 0 or shape[k] * after % block == 0)


class AdamW8bit(_TorchaoAdamW8bit):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        block_size: int = 256,
        compile: bool = True,
    ):
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size
        )
        self.compile = compile

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        """A zero moment for ``p``: 8-bit when the whole ``p`` qualifies (see the module docstring)."""
        if not isinstance(p, DTensor):
            return super()._new_buffer(p, signed)
        local = p.to_local()
        quantise = p.numel() >= MIN_QUANTISED and p.numel() % self.block_size == 0
        if quantise and not blocks_align(p.shape, p.placements, p.device_mesh.shape, self.block_size):
            quantise = False
            if tuple(p.shape) not in _WARNED:
                _WARNED.add(tuple(p.shape))
                log.warning(
                    "adamw8bit: shards of a %s tensor (%s) split its blocks of %d values: FP32 moments for it",
                    "x".join(map(str, p.shape)),
                    ", ".join(map(str, p.placements)),
                    self.block_size,
                )
        out = self._subclass_zeros(local, signed, self.block_size) if quantise else torch.zeros_like(local)
        out = DTensor.from_local(
            out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        return out.to(p.device)

    def state_dict(self) -> dict:
        """torch's state dict with every 8-bit moment dequantised to FP32 (see the module docstring)."""
        sd = super().state_dict()
        sd["state"] = {i: {k: _dense(v) for k, v in s.items()} for i, s in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, then each FP32 moment quantised again where this optimizer keeps it in 8 bits."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if key in state and not _quantised(state[key]):
                        buf = self._new_buffer(p, signed=key == "exp_avg")
                        if _quantised(buf):
                            requantise(_local(buf), _local(state[key]))
                            state[key] = buf

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
        if self.compile:
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)


@torch.no_grad()
def requantise(dst: OptimState8bit, dense: torch.Tensor) -> None:
    """Set ``dst`` to codes and per-block scales that dequantise to exactly ``dense`` where ``dense`` is a
    dequantised 8-bit moment (as :meth:`AdamW8bit.state_dict` gives it); other blocks are quantised as
    torchao does."""
    qmap = dst.qmap
    blocks = dense.detach().float().reshape(-1, dst.block_size)
    top = blocks.abs().amax(1)
    scale = top.clip(1e-12)  # torchao's scale; right unless the block's largest magnitude was negative
    codes = quantize_8bit_with_qmap(blocks / scale[:, None], qmap)
    exact = (qmap[codes.int()] * scale[:, None] == blocks).all(1)
    # a negative extreme sits on the code book's end -0.99297: the scale was top / 0.99297, to an ulp or two
    guess = top / -qmap[0]
    for ulps in (0, -1, 1, -2, 2):
        if bool(exact.all()):
            break
        trial = guess
        for _ in range(abs(ulps)):
            trial = torch.nextafter(trial, torch.full_like(trial, math.copysign(math.inf, ulps)))
        trial_codes = quantize_8bit_with_qmap(blocks / trial[:, None], qmap)
        hit = ~exact & (qmap[trial_codes.int()] * trial[:, None] == blocks).all(1)
        scale = torch.where(hit, trial, scale)
        codes = torch.where(hit[:, None], trial_codes, codes)
        exact |= hit
    dst.codes.copy_(codes.view(dst.codes.shape))
    dst.scale.copy_(scale)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _quantised(t: object) -> bool:
    return isinstance(t, torch.Tensor) and isinstance(_local(t), OptimState8bit)


def _dense(t: object) -> object:
    """An 8-bit moment (possibly inside a DTensor) as FP32 of the same layout; anything else as it is."""
    if not _quantised(t):
        return t
    if isinstance(t, DTensor):
        return DTensor.from_local(
            t.to_local().dequantize(),
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
    return t.dequantize()
