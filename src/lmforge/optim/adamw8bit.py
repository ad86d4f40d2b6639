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
  ``train.compile = false``, or without a C++ compiler on CPU) the same function runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

# Importing torchao (about 8 s; so lmforge imports this module only when adamw8bit is chosen) logs
# warnings about its prebuilt CUDA kernels (FP8 / CUTLASS) and a deprecation in its pytree registrations;
# neither concerns the 8-bit optimizer, which is plain PyTorch plus torch.compile, so they are muted here.
_NOISY = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
_levels = [log.level for log in _NOISY]
for _log in _NOISY:
    _log.setLevel(logging.ERROR)
try:
    from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
finally:
    for _log, _level in zip(_NOISY, _levels, strict=True):
        _log.setLevel(_level)


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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
        if self.compile:
            return super().step(closure)
        with torch.compiler.set_stance("force_eager"):
            return super().step(closure)
