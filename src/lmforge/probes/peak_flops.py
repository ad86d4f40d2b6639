"""The peak FLOP/s a run's model FLOPs utilisation is measured against: the data-sheet dense peak of a
known CUDA device in the run's precision (``plan/hardware.py``), or on a CPU a float32 matmul timed once
per process (:func:`cpu_peak_flops`; ``lmforge estimate --gpu cpu`` uses the same measurement)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from lmforge.plan import hardware


@dataclass(frozen=True)
class Peak:
    flops: float  # dense peak FLOP/s of one device
    source: str  # what it is, for the log: "NVIDIA H200, bf16 data-sheet peak", "cpu, measured fp32 matmul"


def measure_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Float32 matmul FLOP/s of this host: ``2 n^3`` over the best of ``repeats`` timed ``n x n`` products
    (~0.1-1 s). The operands come from a private generator: the run's random streams are untouched."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(n, n, generator=gen), torch.rand(n, n, generator=gen)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.cache
def cpu_peak_flops() -> float:
    """:func:`measure_cpu_peak_flops`, measured once per process."""
    return measure_cpu_peak_flops()


def device_peak(device: torch.device, number_format: str) -> Peak | None:
    """The peak of one ``device`` in ``number_format`` (a policy's name: fp32, tf32, bf16, fp16, fp8); None
    for a CUDA device the hardware table does not know (or other device types)."""
    if device.type == "cpu":
        return Peak(cpu_peak_flops(), "cpu, measured float32 matmul")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    hw = hardware.from_device_name(name, torch.cuda.get_device_properties(device).total_memory)
    if hw is None or number_format not in hw.peak_flops:
        return None
    return Peak(hw.peak(number_format), f"{name} as {hw.name}, {number_format} data-sheet dense peak")
