"""Accelerators the planner knows: memory, dense peak FLOP/s per precision, and link bandwidth.

Figures are NVIDIA's data-sheet numbers for *dense* math (the sparsity figures are twice these and
training does not reach them):

=============  ==================  =======  =======  =======  =======  =======  ==================
device         memory (nvidia-smi)  bf16     fp16     fp8      tf32     fp32     NVLink per GPU
=============  ==================  =======  =======  =======  =======  =======  ==================
h100-80gb      81,559 MiB          989.4 T  989.4 T  1979 T   494.7 T  66.9 T   450 GB/s each way
h200           143,771 MiB         989.4 T  989.4 T  1979 T   494.7 T  66.9 T   450 GB/s each way
a100-80gb      81,920 MiB          312 T    312 T    --       156 T    19.5 T   300 GB/s each way
a100-40gb      40,960 MiB          312 T    312 T    --       156 T    19.5 T   300 GB/s each way
=============  ==================  =======  =======  =======  =======  =======  ==================

Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOPS BF16/FP16 and 1,979 FP8 dense, TF32 495,
FP32 67, NVLink 900 GB/s bidirectional), NVIDIA H200 data sheet (same compute as
H100 SXM, 141 GB HBM3e), NVIDIA A100 data sheet (SXM4: 312 TFLOPS BF16/FP16 dense, 156 TF32, 19.5 FP32,
NVLink 600 GB/s bidirectional; A100 has no FP8). Between nodes: one 400 Gb/s (H100/H200, DGX H100's
ConnectX-7) or 200 Gb/s (A100, DGX A100's HDR) InfiniBand port per GPU, 50 or 25 GB/s each way. Memory is the total ``nvidia-smi`` reports for each board
(what "80 GB" means in practice: 79.6 GiB on an H100, 80 GiB on an A100 80GB). The A100 has no FP8 units:
asking for fp8 there is an error, not a silent fallback.

``cpu``: the host's RAM (``os.sysconf``) and a peak FLOP/s the caller measures (``lmforge estimate`` times
a float32 matmul); nothing here runs a kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MIB = 2**20
TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    """One device: ``memory_bytes``, dense ``peak_flops`` per precision name, ``link_bytes_per_s``
    (per GPU, one direction, inside a node) and ``node_link_bytes_per_s`` (per GPU between nodes), used
    for the exposed-communication term of the throughput model."""

    name: str
    memory_bytes: int
    peak_flops: dict[str, float] = field(default_factory=dict)
    link_bytes_per_s: float = 0.0
    node_link_bytes_per_s: float = 0.0
    source: str = ""

    def peak(self, number_format: str) -> float:
        """Dense peak FLOP/s in ``number_format`` (fp32, tf32, bf16, fp16, fp8: a planned run's
        ``train.precision``, no device's policy); KeyError names the choices."""
        if number_format not in self.peak_flops:
            raise KeyError(
                f"{self.name} has no {number_format} peak; it has {', '.join(sorted(self.peak_flops))}"
            )
        return self.peak_flops[number_format]


def _hopper(name: str, memory_mib: int, source: str) -> Hardware:
    flops = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}
    return Hardware(name, memory_mib * MIB, {k: v * TERA for k, v in flops.items()}, 450e9, 50e9, source)


def _ampere(name: str, memory_mib: int, source: str) -> Hardware:
    flops = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
    return Hardware(name, memory_mib * MIB, {k: v * TERA for k, v in flops.items()}, 300e9, 25e9, source)


GPUS: dict[str, Hardware] = {
    "h100-80gb": _hopper("h100-80gb", 81_559, "NVIDIA H100 SXM5 data sheet"),
    "h200": _hopper("h200", 143_771, "NVIDIA H200 SXM data sheet"),
    "a100-80gb": _ampere("a100-80gb", 81_920, "NVIDIA A100 SXM4 data sheet"),
    "a100-40gb": _ampere("a100-40gb", 40_960, "NVIDIA A100 SXM4 data sheet"),
}
NAMES = (*GPUS, "cpu")


def from_device_name(device_name: str, memory_bytes: int | None = None) -> Hardware | None:
    """The table's entry for a CUDA device as ``torch.cuda.get_device_name()`` names it ("NVIDIA H200",
    "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"; ``memory_bytes`` picks the A100's size when the
    name does not say it); None for a device the table does not hold, including the PCIe and NVL
    boards of the H100 and H200, whose peaks are lower than the SXM figures here (the A100's PCIe board
    has the SXM4 peaks)."""
    name = device_name.upper()
    if "A100" in name:
        small = "40GB" in name or (memory_bytes is not None and memory_bytes < 60 * 2**30)
        return GPUS["a100-40gb" if small else "a100-80gb"]
    if "PCIE" in name or "NVL" in name or "GH200" in name:
        return None
    if "H200" in name:
        return GPUS["h200"]
    if "H100" in name:
        return GPUS["h100-80gb"]
    return None


def host_memory_bytes() -> int:
    """This machine's physical RAM: ``SC_PAGE_SIZE * SC_PHYS_PAGES``."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu(peak_flops: float, memory_bytes: int | None = None, link_bytes_per_s: float = 10e9) -> Hardware:
    """The host as a device: RAM (default :func:`host_memory_bytes`) and a measured float32 peak, used for
    every precision (a CPU without native BF16 emulates it, lmforge then trains in FP32). The link figure
    (10 GB/s, a memory copy between processes) only matters for multi-process CPU runs."""
    mem = host_memory_bytes() if memory_bytes is None else memory_bytes
    flops = dict.fromkeys(("fp32", "tf32", "bf16", "fp16"), peak_flops)
    return Hardware(
        "cpu", mem, flops, link_bytes_per_s, link_bytes_per_s, "host RAM (os.sysconf) and a measured matmul"
    )


def get(name: str, cpu_peak_flops: float | None = None) -> Hardware:
    """The device called ``name`` (``cpu`` needs ``cpu_peak_flops``); KeyError lists the known names."""
    if name == "cpu":
        if cpu_peak_flops is None:
            raise KeyError("cpu: give its measured peak FLOP/s")
        return cpu(cpu_peak_flops)
    if name not in GPUS:
        raise KeyError(f"unknown device {name!r}; known: {', '.join(NAMES)}")
    return GPUS[name]
