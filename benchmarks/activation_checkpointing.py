"""Saved-activation bytes, step time and compute of each activation-checkpointing policy, against ``none``.

One Llama-style model (default 12 layers, d_model 256, 4 heads, vocab 4096; batch 4 x 256 tokens, FP32,
eager) runs forward + backward through lmforge's training objective (``NextTokenLoss``, loss chunk 1024)
under each policy of ``train.activation_checkpointing``, set on the same model by the stage's own
function (``lmforge.parallel.apply.set_activation_checkpointing``). For each policy:

* saved bytes: what the forward keeps alive for backward
  (``lmforge.probes.activation_memory.saved_activation_bytes``: storages, each once; deterministic);
* step time: forward + backward (no optimizer step), the median over ``--rounds`` rounds of ``--steps``
  steps each after one warm-up step; policies interleave within each round (the order rotating), so drift
  in the speed of a shared machine hits all alike. Wall time and the process's CPU time (all its threads)
  are both given: on a machine shared with other jobs the CPU time is the steadier of the two, since
  waiting for a core does not count in it;
* matmul FLOPs of forward + backward (``torch.utils.flop_counter.FlopCounterMode``), recomputation
  included: the compute figure, free of timing noise (attention kernels count only where FlopCounterMode
  has a formula for them: not SDPA's CPU flash kernel).

Each is printed with its ratio to ``none`` in the same run, next to the seed lessons' claims (full
checkpointing ~1.3-1.4x time or "about 2x compute"; checkpointing every sqrt(L) layers O(sqrt L) memory
at ~1.5x). It also prints a block's input next to what a block saves inside (why ``every:K`` checkpoints
one block in K rather than segments of K blocks: see ``lmforge/parallel/apply.py``).

    python benchmarks/activation_checkpointing.py [--layers 12] [--d-model 256] [--batch 4] [--seq 256]
        [--rounds 5] [--steps 2] [--policies none,full,...] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from lmforge.config import ModelConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.parallel.apply import set_activation_checkpointing
from lmforge.probes.activation_memory import saved_activation_bytes

POLICIES = ["none", "full", "every:2", "every:3", "every:4", "selective"]
CLAIMS = {
    "full": "seed: ~1.3-1.4x time, or 'about 2x compute'",
    "every:3": "seed (every sqrt(L) layers): O(sqrt L) memory at ~1.5x",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if policies[0] != "none":
        policies.insert(0, "none")  # the baseline of every ratio

    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads)
    model = Transformer(cfg, args.vocab, args.seq)
    model.init_weights()
    objective = NextTokenLoss(model, 1024)
    x = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs, targets = x[:, :-1], x[:, 1:]

    def step() -> None:
        loss, _ = objective(inputs, targets)
        loss.backward()
        model.zero_grad(set_to_none=True)

    saved, flops = {}, {}
    for policy in policies:
        set_activation_checkpointing(model, policy)
        saved[policy] = saved_activation_bytes(lambda: objective(inputs, targets))
        counter = FlopCounterMode(display=False)
        with counter:
            step()
        flops[policy] = counter.get_total_flops()

    times: dict[str, list[float]] = {p: [] for p in policies}
    cpu: dict[str, list[float]] = {p: [] for p in policies}
    for round_ in range(args.rounds):
        order = policies[round_ % len(policies) :] + policies[: round_ % len(policies)]
        for policy in order:
            set_activation_checkpointing(model, policy)
            step()  # warm-up
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                step()
            times[policy].append((time.perf_counter() - start) / args.steps)
            cpu[policy].append((time.process_time() - start_cpu) / args.steps)

    med = {p: statistics.median(v) for p, v in times.items()}
    med_cpu = {p: statistics.median(v) for p, v in cpu.items()}
    block_input = args.batch * args.seq * args.d_model * 4
    per_block = (saved["none"] - saved["full"]) / args.layers + block_input
    print(
        f"llama {args.layers} x {args.d_model}, {args.heads} heads, vocab {args.vocab}, batch {args.batch} x "
        f"{args.seq}, FP32 eager, {torch.get_num_threads()} threads; time: median of {args.rounds} rounds "
        f"x {args.steps} fwd+bwd steps"
    )
    print(
        f"{'policy':10} {'saved MB':>9} {'x none':>7} {'ms/step':>9} {'x none':>7} {'CPU ms':>8} {'x none':>7} "
        f"{'matmul GFLOP':>13} {'x none':>7}  seed claim"
    )
    rows = []
    for p in policies:
        row = {
            "policy": p,
            "saved_bytes": saved[p],
            "saved_ratio": saved[p] / saved["none"],
            "step_s": med[p],
            "step_times_s": times[p],
            "time_ratio": med[p] / med["none"],
            "cpu_s": med_cpu[p],
            "cpu_times_s": cpu[p],
            "cpu_ratio": med_cpu[p] / med_cpu["none"],
            "matmul_flops": flops[p],
            "flops_ratio": flops[p] / flops["none"],
        }
        rows.append(row)
        print(
            f"{p:10} {saved[p] / 1e6:9.1f} {row['saved_ratio']:7.3f} {med[p] * 1e3:9.0f} "
            f"{row['time_ratio']:7.3f} {med_cpu[p] * 1e3:8.0f} {row['cpu_ratio']:7.3f} {flops[p] / 1e9:13.1f} {row['flops_ratio']:7.3f}  {CLAIMS.get(p, '')}"
        )
    print(
        f"a block's input: {block_input / 1e6:.2f} MB; what a block saves inside without checkpointing: "
        f"{per_block / 1e6:.2f} MB ({per_block / block_input:.0f}x its input)"
    )
    if args.json:
        shape = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "vocab", "batch", "seq")}
        result = {
            "shape": shape,
            "rounds": args.rounds,
            "steps": args.steps,
            "threads": torch.get_num_threads(),
        }
        result.update(rows=rows, block_input_bytes=block_input, block_saved_bytes=per_block)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
