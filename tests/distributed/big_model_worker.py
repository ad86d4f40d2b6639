"""Worker: a model bigger than one rank is built and trained, and no rank ever holds it whole.

    torchrun --nproc-per-node=N big_model_worker.py OVERRIDES_JSON

Builds the run as ``lmforge train`` does (``build_run``: meta device, transformations, then each rank
materialises and initialises its own shards), then trains ``train.steps`` optimizer steps. Two measures
of every rank's memory, both from outside lmforge's code:

* PyTorch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``: every tensor storage the process
  allocates, followed by a dispatch mode and weak references) around the build, and around the training
  steps: the peak bytes of live tensors on the device;
* the process's resident set (``/proc/self/status``: ``VmHWM``, the high-water mark, reset before each
  phase): how far above its size before the build (``VmRSS``: the interpreter, torch, the data) the
  process grew.

Each rank reports its figures with the bytes it should hold: its own shards (the local parameters after
the build), the largest single parameter of the whole model, and the whole model's FP32 bytes. Rank 0
prints one line ``BIG {json}`` with every rank's figures and the losses.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from lmforge.model.transformer import Transformer
from lmforge.parallel.layout import end_process_group
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.modules import prepare_on_rank0
from lmforge.train.step import train_step


def status_kib(key: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``: resident now; ``VmHWM``: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_hwm() -> None:
    """Start a new resident-set high-water mark (``/proc/self/clear_refs``: 5 resets ``VmHWM`` to ``VmRSS``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def tracked_peak(tracker: MemTracker) -> int:
    """Peak bytes of live tensors the tracker saw on real devices (the meta device holds no memory)."""
    peaks = tracker.get_tracker_snapshot("peak")
    return sum(stats["Total"] for device, stats in peaks.items() if device.type != "meta")


def fix_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, nbytes)``: blocks of ``nbytes`` or more are mapped on their own and
    returned to the system when freed, and the dynamic threshold is off (what ``MALLOC_MMAP_THRESHOLD_``
    does at process start). With glibc's default, raised up to 32 MiB by the first large free, the freed
    parameter and all-gather buffers stay in the heap and the resident set measured 1.2-1.46 GB per rank
    for 0.73 GB of live tensors."""
    m_mmap_threshold = -3  # malloc.h
    if ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, nbytes) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def main() -> None:
    torch.set_num_threads(1)
    fix_mmap_threshold()
    cfg = load_config(None, json.loads(sys.argv[1]))
    from lmforge.parallel.layout import init_layout

    layout = init_layout(cfg, "cpu")
    data = prepare_on_rank0(cfg, layout)  # the data first: only the model is measured
    with torch.device("meta"):
        whole = Transformer(cfg.model, data.tokenizer.vocab_size, cfg.data.seq_len)
    model_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    largest = max(p.numel() * p.element_size() for p in whole.parameters())

    reset_hwm()
    base = status_kib("VmRSS")  # the process before any of the model exists
    build_tracker = MemTracker()
    with build_tracker:
        run = build_run(cfg, data)
    build_rss = (status_kib("VmHWM") - base) * 1024
    build_peak = tracked_peak(build_tracker)
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for p in run.model.parameters()
    )

    reset_hwm()
    step_tracker = MemTracker()
    step_tracker.track_external(run.model, run.optimizer)
    losses = []
    with step_tracker:
        for _ in range(cfg.train.steps):
            batches = [run.loader.next_batch() for _ in range(run.accum)]
            result = train_step(
                run.module,
                run.optimizer,
                batches,
                cfg.optim.lr,
                run.clipper,
                run.precision,
                reduce=run.reduce,
            )
            losses.append(float(result.loss))
            step_tracker.reset_mod_stats()  # per-module figures of one step only (the peak stays)
    train_peak = tracked_peak(step_tracker)
    train_rss = (status_kib("VmHWM") - base) * 1024

    mine = {
        "rank": dist.get_rank(),
        "local_bytes": local,
        "build_peak": build_peak,
        "build_rss": build_rss,
        "train_peak": train_peak,
        "train_rss": train_rss,
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out = {"model_bytes": model_bytes, "largest_param": largest, "losses": losses, "ranks": every}
        print("BIG " + json.dumps(out), flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
