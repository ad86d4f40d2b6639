"""Speed and memory of the output head + cross-entropy: lmforge's fused loss against the unfused loss,
the former chunked loss and PyTorch's ``F.linear_cross_entropy``, in one run with the same dtype, tokens
and compile setting.

Every variant maps ``(hidden (N, d) FP32, targets (N,))`` and a head weight ``(V, d)`` (an FP32
parameter) to the FP32 sum of token cross-entropies, and is timed forward + backward (gradients of the
hidden states and the weight), under BF16 autocast (``--precision bf16``, the default recipe's policy on
a CPU with AVX-512-BF16) or in FP32:

* ``unfused``: ``F.cross_entropy(F.linear(h, W).float(), y, reduction="sum")``, all N x V logits at once
  (what a plain training loop does).
* ``chunked``: lmforge's former ``ChunkedCrossEntropy`` (the same, ``--chunk`` tokens at a time; autograd
  keeps every chunk's FP32 log-softmax).
* ``fused``: lmforge's ``OutputHead`` with targets (``model/fused_loss.py``), as training runs it: a sum
  that precomputes its gradients in forward or recomputes the logits in backward as
  ``model/fused_loss.py::precomputes`` decides (it precomputes at the default recipe's shapes and at the
  memory shapes below); with ``--compile`` its element-wise kernels compiled (``OutputHead.compile_loss``),
  the loop itself not traced.
* ``fused_recompute``: the same loss always recomputing (the per-token path, summed).
* ``fused_eager_kernels`` (with ``--compile``): ``fused`` with eager kernels.
* ``fused_traced`` (speed only, with ``--compile``): the fused loss's autograd Function (eager kernels)
  traced into the compiled graph instead of run as it is (what ``torch.compiler.disable`` in
  ``model/fused_loss.py`` gives up; its memory is then the partitioner's, see there).
* ``torch_lce``: ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions(batch_chunk_size=chunk)``
  on the compute-dtype casts of ``h`` and ``W`` (it is a custom op that autocast does not cast); its
  loss comes back in the compute dtype and is upcast.

Speed: each round runs every variant ``--steps`` times, the order rotating from round to round; medians
of the per-step times, and each variant's ratio to ``unfused`` (and to ``chunked``). With ``--compile``
(the default) every variant goes through ``lmforge.parallel.apply.compile_like_training``, as the
training objective does. Memory (eager, at ``--memory-tokens`` x ``--memory-vocab``): bytes the forward
keeps for backward (``lmforge.probes.activation_memory.saved_activation_bytes``) and the peak of tensors
alive during forward + backward above the inputs and the weight (``torch.distributed._tools.mem_tracker``).
``torch_lce`` is left out of the memory figures: it is a custom op, whose internal tensors a dispatch-mode
tracker does not see.

    python benchmarks/fused_loss.py [--tokens 2048] [--d-model 256] [--vocab 4096] [--chunk 1024]
        [--precision bf16|fp32] [--no-compile] [--rounds 5] [--steps 5] [--threads N]
        [--memory-tokens 4096] [--memory-vocab 8192]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from lmforge.model.fused_loss import EAGER, _FusedCrossEntropy, linear_cross_entropy
from lmforge.model.head import OutputHead, compute_dtype
from lmforge.parallel.apply import COMPILE_OPTIONS, compile_like_training
from lmforge.probes.activation_memory import saved_activation_bytes

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def variants(head: OutputHead, chunk: int, dtype: torch.dtype) -> dict[str, Loss]:
    """Every variant's ``(hidden, targets) -> FP32 loss sum`` on ``head``'s weight."""
    weight = head.weight

    def unfused(h, y):
        return F.cross_entropy(F.linear(h, weight).float(), y, reduction="sum")

    def chunked(h, y):
        total = h.new_zeros((), dtype=torch.float32)
        for hc, yc in zip(h.split(chunk), y.split(chunk), strict=True):
            total = total + F.cross_entropy(F.linear(hc, weight).float(), yc, reduction="sum")
        return total

    def fused(h, y):
        return head(h, y, chunk=chunk)

    def fused_eager_kernels(h, y):
        return linear_cross_entropy(h, weight, y, chunk=chunk, dtype=compute_dtype(h.device, weight))

    def fused_recompute(h, y):  # the per-token path (never precomputed), summed
        return head(h, y, chunk=chunk, reduction="none").sum()

    def fused_traced(h, y):
        dtype = compute_dtype(h.device, weight)
        return _FusedCrossEntropy.apply(h, weight, y, 1.0, chunk, dtype, None, 0, EAGER).sum()

    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk)

    def torch_lce(h, y):
        out = F.linear_cross_entropy(h.to(dtype), weight.to(dtype), y, reduction="sum", options=options)
        return out.float()

    return {
        "unfused": unfused,
        "chunked": chunked,
        "fused": fused,
        "fused_recompute": fused_recompute,
        "fused_eager_kernels": fused_eager_kernels,
        "fused_traced": fused_traced,
        "torch_lce": torch_lce,
    }


def inputs(n: int, d: int, v: int, seed: int = 0) -> tuple[OutputHead, torch.Tensor, torch.Tensor]:
    """A head of init std 0.02, unit-variance hidden states (as after the final norm), targets with
    every tenth ignored."""
    g = torch.Generator().manual_seed(seed)
    head = OutputHead(d, v)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g) * 0.02)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::10] = -100
    return head, hidden, targets


def step(fn: Loss, head: OutputHead, hidden: torch.Tensor, targets: torch.Tensor, autocast) -> float:
    """One forward + backward; returns the loss."""
    with autocast():
        loss = fn(hidden, targets)
    loss.backward()
    hidden.grad = head.weight.grad = None
    return loss.item()


def speed(args, autocast, dtype: torch.dtype) -> dict:
    head, hidden, targets = inputs(args.tokens, args.d_model, args.vocab)
    fns = variants(head, args.chunk, dtype)
    if not args.compile:
        del fns["fused_traced"], fns["fused_eager_kernels"]
    else:
        head.compile_loss(**COMPILE_OPTIONS)
        fns = {name: compile_like_training(fn) for name, fn in fns.items()}
    losses = {}
    for name, fn in fns.items():  # warm-up (compilation)
        for _ in range(args.warmup):
            losses[name] = step(fn, head, hidden, targets, autocast)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            for _ in range(args.steps):
                t = time.perf_counter()
                step(fns[name], head, hidden, targets, autocast)
                times[name].append(time.perf_counter() - t)
        line = ", ".join(f"{n} {statistics.median(t) * 1e3:.1f}" for n, t in times.items())
        print(f"round {r + 1}/{args.rounds} (ms, medians so far): {line}", flush=True)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "ms": {k: round(v, 2) for k, v in ms.items()},
        "vs_unfused": {k: round(ms["unfused"] / v, 3) for k, v in ms.items()},
        "vs_chunked": {k: round(ms["chunked"] / v, 3) for k, v in ms.items()},
        "loss": losses,
    }


def memory(args, autocast, dtype: torch.dtype) -> dict:
    head, hidden, targets = inputs(args.memory_tokens, args.d_model, args.memory_vocab)
    out = {}
    for name, fn in variants(head, args.chunk, dtype).items():
        if name in ("fused_eager_kernels", "fused_traced", "torch_lce"):  # eager: "fused"; torch_lce: above
            continue

        def forward(fn=fn):
            with autocast():
                return fn(hidden, targets)

        saved = saved_activation_bytes(forward)
        tracker = MemTracker()
        tracker.track_external(hidden, head.weight)
        with tracker:
            forward().backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        base = hidden.numel() * 4 + head.weight.numel() * 4  # the inputs and the weight, there before
        hidden.grad = head.weight.grad = None
        out[name] = {"saved_mib": round(saved / 2**20, 2), "peak_mib": round((peak - base) / 2**20, 2)}
        print(
            f"memory {name}: saved {out[name]['saved_mib']} MiB, peak {out[name]['peak_mib']} MiB", flush=True
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="N: the default recipe's batch 8 x 256")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024, help="train.loss_chunk")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's)")
    ap.add_argument("--memory-tokens", type=int, default=4096)
    ap.add_argument("--memory-vocab", type=int, default=8192)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def autocast():
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=dtype)

    result = {
        "shape": {"tokens": args.tokens, "d_model": args.d_model, "vocab": args.vocab, "chunk": args.chunk},
        "precision": args.precision,
        "compile": args.compile,
        "threads": torch.get_num_threads(),
        "memory_shape": {"tokens": args.memory_tokens, "vocab": args.memory_vocab, "chunk": args.chunk},
        "memory": memory(args, autocast, dtype),
        **speed(args, autocast, dtype),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
