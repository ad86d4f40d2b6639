"""The numeric precision policy of a run: one object answers every precision question.

``auto`` picks BF16 only where the hardware computes it natively: a CUDA GPU with BF16 support, or a
CPU with AVX-512-BF16 or AMX tiles. Elsewhere (for example AVX2-only CPUs) BF16 matrix products are
emulated and run tens of times slower than FP32, so ``auto`` picks FP32 and ``bf16`` warns.

A :class:`PrecisionPolicy` is built once per run (:meth:`PrecisionPolicy.resolve`) and answers:

* :meth:`~PrecisionPolicy.autocast`: the context forward passes (training and evaluation) run in;
* :meth:`~PrecisionPolicy.backward`: how a loss is differentiated;
* :meth:`~PrecisionPolicy.unscale_`: what must happen to gradients before they are measured or clipped;
* :meth:`~PrecisionPolicy.step`: how the optimizer step is taken (whether it was taken);
* :attr:`~PrecisionPolicy.eval_dtype`: the dtype evaluation computes in.

For ``fp32`` and ``bf16`` the loss scaler is a do-nothing one (BF16 has FP32's exponent range), so
``backward`` is ``loss.backward()`` and ``step`` is ``optimizer.step()``. FP16's dynamic loss scaling
and FP8's model conversion plug into these same seams (``unscale_``/``step`` and the conversion stage of
``lmforge.parallel.apply``) without changing any caller.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies BF16 matrices in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` where native, else ``fp32``; explicit choices are kept (with a warning if slow)."""
    if requested == "auto":
        chosen = "bf16" if native_bf16(device) else "fp32"
        log.info("precision: auto -> %s (native BF16 on %s: %s)", chosen, device.type, native_bf16(device))
        return chosen
    if requested == "bf16" and not native_bf16(device):
        log.warning(
            "train.precision: bf16 on a %s without native BF16 is emulated and much slower than fp32; "
            "use --train.precision=auto",
            device.type,
        )
    return requested


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one run computes: ``name`` is ``fp32`` or ``bf16`` (autocast over FP32 master weights)."""

    name: str
    device: torch.device

    @classmethod
    def resolve(cls, requested: str, device: torch.device) -> PrecisionPolicy:
        """The policy for ``train.precision`` on ``device`` (``auto`` resolved; see the module docstring)."""
        return cls(resolve_precision(requested, device), device)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix products run in."""
        return DTYPES[self.name]

    @property
    def eval_dtype(self) -> torch.dtype:
        """The dtype evaluation computes in: the training compute dtype, so validation measures the
        function that was trained."""
        return self.compute_dtype

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward passes run in: BF16 autocast for ``bf16``, nothing for ``fp32``."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Differentiate ``loss`` (gradients accumulate); a loss scaler would scale it first."""
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before they are measured or clipped (a no-op without a
        loss scaler)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step; returns whether it was taken (a scaler may skip overflowing steps)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        """The scaler's state (empty for the do-nothing scaler)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
