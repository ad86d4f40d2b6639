"""Numeric precision policy: FP32, or BF16 autocast over FP32 master weights.

``auto`` picks BF16 only where the hardware computes it natively: a CUDA GPU with BF16 support, or a
CPU with AVX-512-BF16 or AMX tiles. Elsewhere (for example AVX2-only CPUs) BF16 matrix products are
emulated and run tens of times slower than FP32, so ``auto`` picks FP32 and ``bf16`` warns.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)


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


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context in which forward passes run: BF16 autocast for ``bf16``, nothing for ``fp32``."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
