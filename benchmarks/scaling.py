"""Data-parallel scaling on this machine: tokens/s and per-rank memory under DDP, ZeRO-1, ZeRO-2 and ZeRO-3.

The driver starts, for each layout and process count N, ``torchrun --standalone --nproc-per-node=N
benchmarks/scaling.py --worker ...`` with ``OMP_NUM_THREADS = max(1, cores // N)``, so that N processes
share this machine's cores instead of oversubscribing them (on 2 cores: 2 threads for one process, 1 each
for two, and 1 each for four, which then still oversubscribe the two cores two to one). N = 1 is one
plain process: lmforge runs a single process without any wrapper whatever ``parallel.zero`` says, so that
one run is the baseline row of every layout.

=========  ==============================================================  =================================
layout     lmforge                                                         overrides
=========  ==============================================================  =================================
ddp        ``DistributedDataParallel``                                     ``parallel.dp_replicate=N``
zero1      DDP + ``ZeroRedundancyOptimizer`` (``build_zero_optimizer``)    ``parallel.dp_shard=N``, ``zero=1``
zero2      FSDP2, ``reshard_after_forward=False``                          ``parallel.dp_shard=N``, ``zero=2``
zero3      FSDP2, full sharding                                            ``parallel.dp_shard=N``, ``zero=3``
=========  ==============================================================  =================================

Each worker builds its run through lmforge's build path (``lmforge.train.build.build_run`` with a config
from ``lmforge.recipe.load_config``) on the built-in corpus (``builtin:pystdlib``, prepared once by the
driver into ``data.cache_dir``), with the same global batch for every N (``train.tokens_per_step``; each
rank accumulates ``tokens_per_step / (micro_batch_size x seq_len x N)`` micro-batches). It takes
``--warmup`` untimed and ``--steps`` timed ``train_step`` calls; a step's time is the slowest rank's, and
global tokens/s = tokens_per_step / median step time. One more step is then run in its pieces with
lmforge's own functions (``forward_backward`` per micro-batch under ``StepReduce``, the clipper,
``set_lr``, the precision policy's ``step``) to measure, on every rank, the bytes it holds of:

* parameters at rest: every parameter of the model once (tied ones once), the local shard of a DTensor;
* gathered parameters: what FSDP2 holds unsharded between forward and backward (a forward hook on the
  training objective, registered after FSDP2's own, reads the parameters then registered on the
  modules: gathered ones are plain tensors, in the compute dtype);
* gradients: right after the last backward, before the optimizer step (local shards of DTensors);
* optimizer states: after the step (``ZeroRedundancyOptimizer``: its rank's ``.optim.state``);
* DDP's gradient buckets (``bucket_sizes`` of DDP's logging data): with ``gradient_as_bucket_view``
  off, DDP all-reduces flat copies of the gradients, 4P bytes besides the gradients themselves; shown
  apart, not in the state totals, like FSDP2's transient communication buffers;
* the process's peak resident set (``ru_maxrss``): everything, interpreter, libraries and activations.

State per rank is reported *at rest* (parameters + gradients + optimizer states, after the step and
before ``zero_grad``) and at the *peak of the states*: the larger of that and the moment between the
last micro-batch's forward and its backward, when the gathered parameters are held together with the
gradients accumulated by the earlier micro-batches (the hook reads those too). The benchmark prints the
largest rank of each figure, and the JSON line every rank's.

Formulas (P parameters, embedding included, N data-parallel ranks; bytes). The seed lessons' table
assumes mixed-precision Adam: BF16 parameters and gradients, FP32 master weights and two FP32 moments
(2 + 2 + 12 bytes per parameter): DDP 16P, ZeRO-1 4P + 12P/N, ZeRO-2 2P + 14P/N, ZeRO-3 16P/N.
lmforge's dtypes differ: its parameters *are* the FP32 master weights (there is no separate copy; under
``bf16`` it autocasts, and FSDP2 gathers BF16 copies through ``MixedPrecisionPolicy``), its gradients
are FP32 (FSDP2 reduces in FP32 and keeps FP32 gradient shards), and AdamW keeps two FP32 moments
(4 + 4 + 8 bytes per parameter). With g the bytes of a gathered parameter (4 under fp32, 2 under bf16),
and gradient accumulation (at one micro-batch per step the peak of ZeRO-2 lacks its 4P/N of gradients):

=======  ==========  =================  ==========================================================
layout   seed        lmforge at rest    lmforge peak of the states
=======  ==========  =================  ==========================================================
1 proc   16P         16P                16P
ddp      16P         16P (+4P buckets)  16P (+4P buckets)
zero1    4P + 12P/N  8P + 8P/N (+4P)    8P + 8P/N (+4P buckets)
zero2    2P + 14P/N  16P/N              16P/N + gP (every parameter gathered from forward to backward)
zero3    16P/N       16P/N              16P/N + gR (R: root parameters, embedding and final norm)
=======  ==========  =================  ==========================================================

The totals agree for DDP and ZeRO-3 (16 bytes per parameter either way, split 4 + 4 + 8 instead of
2 + 2 + 12). ZeRO-1 differs because lmforge's replicated part is FP32 parameters and gradients (8P)
instead of BF16 ones (4P). ZeRO-2 differs because FSDP2 reshards the parameters after backward (at rest
nothing is replicated) and holds all of them gathered from forward to backward, at 4 bytes under fp32;
under bf16 they are gathered in BF16 (2P, the seed's replicated part), but the gradient shards stay FP32,
so the peak is 2P + 16P/N against the seed's 2P + 14P/N (measured with ``--train.precision=bf16
--procs 2``: 40.65 MiB, the formula's figure, 1.111 times the seed's). The seed's
ZeRO-2 keeps its parameters gathered throughout, so its column is compared with the measured peak;
every other seed figure with the state at rest. Under ZeRO-3 the blocks are resharded after forward;
the root (embedding, final norm, tied head) stays gathered from forward to backward (FSDP2's default
for a root: backward needs it at once), which adds its parameters to the peak. Backward gathers one
block and prefetches the next; that
transient (at most two blocks' parameters and unsharded gradients) is not in the snapshot. The optimizer's
step counters (one 4-byte tensor per parameter tensor under fused AdamW) count in the measured states
(hence ratios of 1.000 and not exactly 1). ZeRO-1 partitions whole parameters among the ranks (largest
first, each to the least loaded rank), so its largest rank holds somewhat more than 8P/N of moments.

    python benchmarks/scaling.py [--steps 10] [--warmup 3] [--procs 1,2,4] [--layouts ddp,zero1,zero2,zero3]
                                 [--threads T] [--SECTION.KEY=VALUE ...]

Defaults: the default recipe's model (Llama 4 x 256, vocab 4096: 4.26M parameters), ``data.seq_len``
256, ``train.micro_batch_size`` 2, ``train.tokens_per_step`` 4096 (8 / 4 / 2 micro-batches per rank for
N = 1 / 2 / 4), eager (``train.compile=false``: compiling each layout's blocks would cost more than the
timed steps), ``train.precision`` as the recipe resolves it (FP32 on a CPU without native BF16). If
``lmforge.optim.build`` has no ``build_zero_optimizer`` in this tree, ZeRO-1 is reported as not measured.
The driver also reports how many cores *other* programs kept busy during each run (the machine's busy
time from ``/proc/stat`` minus the run's own), since timings on shared cores mean little without it.
The last line printed is one JSON object with every run's per-rank figures.

Measured here (2-core AMD EPYC, AVX2 only, torch 2.13 CPU, gloo; ``--steps 6 --warmup 2``, FP32) while
the test suite ran on the same cores ("others" column): the tokens/s are indicative only, and the
one-process row (2 threads) suffered most from the shared cores. The memory figures are exact: every
state matches lmforge's formula (ZeRO-1's largest rank holds 0.2-0.9% more: whole parameters are
partitioned). Against the seed's formula one process, DDP and ZeRO-3 match (1.000); ZeRO-1 (1.20, 1.44)
and ZeRO-2 (1.33, 1.46) miss because this run is FP32 (replicated or gathered parameters at 4 bytes,
not 2; gradients 4 bytes, not 2)::

    P = 4,262,144 parameters, 4,096 tokens per step, fp32, 2 cores; per rank: the largest; MiB = 2^20 B
    layout   N thr accum   tok/s  vs 1 step s RSS MiB others
    1 proc   1   2     8     201  1.00  20.36     552   0.97
    ddp      2   1     4   2,380 11.83   1.72     581   0.78
    ddp      4   1     2   2,264 11.26   1.81     562   0.69
    zero1    2   1     4   2,502 12.44   1.64     565   0.79
    zero1    4   1     2   2,546 12.66   1.61     531   0.52
    zero2    2   1     4   1,658  8.24   2.47     561   0.73
    zero2    4   1     2   1,892  9.41   2.16     546   0.54
    zero3    2   1     4   1,550  7.71   2.64     566   0.77
    zero3    4   1     2   1,646  8.19   2.49     547   0.54

    layout   N params  grads  optim bucket   rest formula ratio gather   peak formula ratio   seed m/seed
    1 proc   1  16.26  16.26  32.52   0.00  65.04   65.04 1.000   0.00  65.04   65.04 1.000  65.04  1.000
    ddp      2  16.26  16.26  32.52  16.26  65.04   65.04 1.000   0.00  65.04   65.04 1.000  65.04  1.000
    ddp      4  16.26  16.26  32.52  16.26  65.04   65.04 1.000   0.00  65.04   65.04 1.000  65.04  1.000
    zero1    2  16.26  16.26  16.38  16.26  48.89   48.78 1.002   0.00  48.89   48.78 1.002  40.65  1.203
    zero1    4  16.26  16.26   8.50  16.26  41.02   40.65 1.009   0.00  41.02   40.65 1.009  28.45  1.442
    zero2    2   8.13   8.13  16.26   0.00  32.52   32.52 1.000  16.26  48.78   48.78 1.000  36.58  1.333
    zero2    4   4.06   4.06   8.13   0.00  16.26   16.26 1.000  16.26  32.52   32.52 1.000  22.36  1.455
    zero3    2   8.13   8.13  16.26   0.00  32.52   32.52 1.000   4.00  36.52   36.52 1.000  32.52  1.000
    zero3    4   4.06   4.06   8.13   0.00  16.26   16.26 1.000   4.00  20.26   20.26 1.000  16.26  1.000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULT = "SCALING_RESULT "  # prefix of the worker's one result line on rank 0's stdout
MIB = 2**20

LAYOUTS = {
    "ddp": lambda n: {"parallel.dp_replicate": n},
    "zero1": lambda n: {"parallel.dp_shard": n, "parallel.zero": 1},
    "zero2": lambda n: {"parallel.dp_shard": n, "parallel.zero": 2},
    "zero3": lambda n: {"parallel.dp_shard": n, "parallel.zero": 3},
}

DEFAULTS = {
    "data.cache_dir": "data",
    "data.seq_len": 256,
    "train.micro_batch_size": 2,
    "train.tokens_per_step": 4096,
    "train.compile": False,
    "train.sample_tokens": 0,
}


# -- formulas -------------------------------------------------------------------------------------------


def seed_formula(layout: str, p: int, n: int) -> float:
    """Bytes per rank in the seed lessons' table (mixed-precision Adam, 2 + 2 + 12 bytes per parameter):
    the planner's ``zero-paper`` accounting (``lmforge.plan.memory.per_param_formula``)."""
    from lmforge.plan.memory import per_param_formula

    return per_param_formula("ddp" if n == 1 else layout, p, n, 8, "zero-paper").total


def lmforge_parts(layout: str, p: int, n: int, gathered_bytes: int, root: int = 0) -> dict[str, float]:
    """Bytes per rank with lmforge's dtypes (the planner's ``lmforge`` accounting): FP32 parameters (the
    master weights), FP32 gradients, two FP32 AdamW moments, and what FSDP2 holds gathered between forward
    and backward (``gathered_bytes`` per parameter: all of them under ZeRO-2, the ``root`` ones
    (embedding, final norm) under ZeRO-3)."""
    from lmforge.plan.memory import per_param_formula

    kind = "ddp" if n == 1 else layout
    f = per_param_formula(kind, p, n, 8, "lmforge")
    gathered = 0 if kind in ("ddp", "zero1") else gathered_bytes * (p if kind == "zero2" else root)
    return {"params": f.params, "grads": f.grads, "optim": f.optim, "gathered": gathered}


def lmforge_formula(
    layout: str, p: int, n: int, gathered_bytes: int, accum: int, root: int = 0
) -> tuple[float, float]:
    """``(at rest, peak of the states)``: at rest parameters + gradients + optimizer states; the peak is
    the larger of that and the moment between the last forward and its backward, when the gathered
    parameters are held and, with accumulation (``accum`` above 1), the gradients of the earlier
    micro-batches."""
    f = lmforge_parts(layout, p, n, gathered_bytes, root)
    rest = f["params"] + f["grads"] + f["optim"]
    between = f["params"] + f["optim"] + f["gathered"] + (f["grads"] if accum > 1 else 0)
    return rest, max(rest, between)


# -- measuring (worker) ---------------------------------------------------------------------------------


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t``: the local shard of a DTensor, all of a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer states (``ZeroRedundancyOptimizer``: its rank's own optimizer)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lmforge.optim.state_size import state_bytes

    return state_bytes(optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer)


def bucket_bytes(objective: torch.nn.Module) -> int:
    """Bytes of DDP's gradient buckets (0 for anything else)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(objective, DistributedDataParallel):
        return 0
    sizes = str(objective._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(s) for s in sizes.split(",") if s.strip())


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measured_step(run, lr: float) -> dict:
    """One optimizer step in its pieces (lmforge's functions), measuring this rank's bytes on the way."""
    from torch.distributed.tensor import DTensor

    from lmforge.train.step import set_lr

    params = list(run.model.parameters())  # at rest (FSDP2: the sharded DTensors); tied ones once
    sharded = run.layout.kind == "fsdp"
    out = {"params": sum(local_bytes(p) for p in params), "gathered": 0, "grads_between": 0}

    def after_forward(module, args, output):
        # Registered after FSDP2's own post-forward hook: what is gathered now stays so until backward.
        # FSDP2 swaps gathered (plain) tensors onto the modules; the sharded ones keep the gradients.
        gathered = sum(local_bytes(p) for p in run.model.parameters() if not isinstance(p, DTensor))
        gathered = gathered if sharded else 0
        grads = sum(local_bytes(p.grad) for p in params if p.grad is not None)
        if gathered + grads >= out["gathered"] + out["grads_between"]:
            out["gathered"], out["grads_between"] = gathered, grads

    batches = [run.loader.next_batch() for _ in range(run.accum)]
    wrapped = run.module.train_fn  # the model and loss as the layout wrapped them (DDP, FSDP2, compiled)
    handle = wrapped.register_forward_hook(after_forward)
    try:
        reduce, precision = run.reduce, run.precision
        n_targets = reduce.total_targets(sum(b.n_targets for b in batches), precision.device)
        for i, batch in enumerate(batches):
            with run.module.micro_batch(i, len(batches)):
                run.module.forward_backward(batch.to(precision.device), n_targets, reduce.dp, precision)
        run.module.finish_backward()
    finally:
        handle.remove()
    out["grads"] = sum(local_bytes(p.grad) for p in params if p.grad is not None)
    out["buckets"] = bucket_bytes(wrapped)
    precision.unscale_(run.optimizer)
    groups = [g["params"] for g in run.optimizer.param_groups]
    run.clipper.clip(groups, run.clipper.measure(groups))
    set_lr(run.optimizer, lr)
    precision.step(run.optimizer)
    out["optim"] = optimizer_bytes(run.optimizer)
    out["params_after_step"] = sum(local_bytes(p) for p in run.model.parameters())
    run.optimizer.zero_grad(set_to_none=True)
    return out


def worker(args: argparse.Namespace, extra: list[str]) -> None:
    import torch.distributed as dist

    from lmforge.parallel.layout import end_process_group
    from lmforge.recipe import load_config, parse_overrides
    from lmforge.train.build import build_run
    from lmforge.train.step import train_step

    rss_start = rss_peak_bytes()
    cfg = load_config(None, parse_overrides(extra))
    run = build_run(cfg)
    p = sum(q.numel() for q in run.model.parameters())  # DTensor.numel() is the global count
    lr = cfg.optim.lr
    times = []
    for i in range(args.warmup + args.steps):
        batches = [run.loader.next_batch() for _ in range(run.accum)]
        if run.layout.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        train_step(run.module, run.optimizer, batches, lr, run.clipper, run.precision, reduce=run.reduce)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    mem = measured_step(run, lr)
    mem["rss_peak"] = rss_peak_bytes()
    mem["rss_start"] = rss_start
    mine = {"rank": run.layout.rank, "times": times, **mem}
    ranks = [mine]
    if run.layout.distributed:
        ranks = [None] * run.layout.world
        dist.all_gather_object(ranks, mine)
    if run.layout.is_main:
        step_s = statistics.median(max(r["times"][k] for r in ranks) for k in range(args.steps))
        result = {
            "kind": run.layout.kind,
            "world": run.layout.world,
            "dp": run.layout.dp,
            "threads": torch.get_num_threads(),
            "precision": run.precision.name,
            "params": p,
            "root_params": sum(
                q.numel() for n, q in run.model.named_parameters() if not n.startswith("blocks.")
            ),
            "accum": run.accum,
            "tokens_per_step": run.tokens_per_step,
            "step_s": step_s,
            "tokens_per_s": run.tokens_per_step / step_s,
            "ranks": ranks,
        }
        print(RESULT + json.dumps(result), flush=True)
    if run.layout.distributed:
        end_process_group()


# -- driver ---------------------------------------------------------------------------------------------


def zero1_available() -> bool:
    import lmforge.optim.build as optim_build

    return hasattr(optim_build, "build_zero_optimizer")


def busy_cpu_s() -> float | None:
    """CPU seconds every process of this machine has used since boot (``/proc/stat``); None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(n: int, overrides: dict, args: argparse.Namespace, threads: int) -> dict:
    """One torchrun of the worker; its result line parsed (SystemExit with the output if it failed).

    Also ``others_cores``: the CPU other programs of this machine used meanwhile, in cores (the machine's
    busy time minus this run's own), since timings on shared cores mean little without it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    cmd += [__file__, "--worker", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    cmd += [f"--{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    busy0, own0, t0 = busy_cpu_s(), children_cpu_s(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    busy1, own1, wall = busy_cpu_s(), children_cpu_s(), time.perf_counter() - t0
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT) :])
            result["wall_s"] = round(wall, 1)
            others = None if busy0 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
            result["others_cores"] = None if others is None else round(others, 2)
            return result
    raise SystemExit(f"worker failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")


def top(ranks: list[dict], key: str) -> str:
    """The largest rank's ``key`` in MiB, formatted for the table."""
    return f"{max(q[key] for q in ranks) / MIB:6.2f}"


def driver(args: argparse.Namespace, extra: list[str]) -> None:
    from lmforge.data.prepare import prepare_data
    from lmforge.recipe import load_config, parse_overrides

    base = {**DEFAULTS, **parse_overrides(extra)}
    cfg = load_config(None, base)
    t0 = time.perf_counter()
    prepare_data(cfg.data)  # once here, so that no timed run includes tokenizer training
    print(f"data prepared in {time.perf_counter() - t0:.0f}s ({cfg.data.cache_dir})", flush=True)
    cores = os.cpu_count() or 1
    procs = [int(x) for x in args.procs.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    has_zero1 = zero1_available()
    runs: list[dict] = []
    not_measured: list[str] = []
    plan = [("1 proc", 1, {})] if 1 in procs else []
    plan += [(layout, n, LAYOUTS[layout](n)) for layout in layouts for n in procs if n > 1]
    for layout, n, over in plan:
        if layout == "zero1" and not has_zero1:
            not_measured.append(f"zero1 N={n}")
            print(
                f"{layout} N={n}: not measured (lmforge.optim.build has no build_zero_optimizer)", flush=True
            )
            continue
        threads = args.threads or max(1, cores // n)
        r = launch(n, {**base, **over}, args, threads)
        r["layout"] = layout
        runs.append(r)
        print(
            f"{layout} N={n} ({threads} threads each): {r['tokens_per_s']:,.0f} tok/s, step "
            f"{r['step_s']:.2f}s, {r['wall_s']:.0f}s wall, other programs used {r['others_cores']} cores",
            flush=True,
        )
    report(runs, not_measured, cores, args)


def report(runs: list[dict], not_measured: list[str], cores: int, args: argparse.Namespace) -> None:
    if not runs:
        raise SystemExit("nothing measured")
    first = runs[0]
    p = first["params"]
    gathered = 2 if first["precision"] == "bf16" else 4
    base_tps = next((r["tokens_per_s"] for r in runs if r["world"] == 1), None)
    print(
        f"\nP = {p:,} parameters, {first['tokens_per_step']:,} tokens per step, {first['precision']}, "
        f"{cores} cores; per rank: the largest; MiB = 2^20 B"
    )
    print(
        f"{'layout':7s} {'N':>2s} {'thr':>3s} {'accum':>5s} {'tok/s':>7s} {'vs 1':>5s} {'step s':>6s} "
        f"{'RSS MiB':>7s} {'others':>6s}"
    )
    for r in runs:
        r["speedup"] = r["tokens_per_s"] / base_tps if base_tps else None  # no 1-process run: none
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        others = "?" if r["others_cores"] is None else f"{r['others_cores']:.2f}"
        print(
            f"{r['layout']:7s} {r['dp']:2d} {r['threads']:3d} {r['accum']:5d} {r['tokens_per_s']:7,.0f} "
            f"{speedup:>5s} {r['step_s']:6.2f} {max(q['rss_peak'] for q in r['ranks']) / MIB:7.0f} "
            f"{others:>6s}"
        )
    print(
        f"\n{'layout':7s} {'N':>2s} {'params':>6s} {'grads':>6s} {'optim':>6s} {'bucket':>6s} {'rest':>6s} "
        f"{'formula':>7s} {'ratio':>5s} {'gather':>6s} {'peak':>6s} {'formula':>7s} {'ratio':>5s} "
        f"{'seed':>6s} {'m/seed':>6s}"
    )
    out_runs = []
    for r in runs:
        layout, n, ranks = r["layout"], r["dp"], r["ranks"]
        rest = [q["params"] + q["grads"] + q["optim"] for q in ranks]
        between = [q["params"] + q["optim"] + q["gathered"] + q["grads_between"] for q in ranks]
        peak = [max(a, b) for a, b in zip(rest, between, strict=True)]
        f_rest, f_peak = lmforge_formula(layout, p, n, gathered, r["accum"], r.get("root_params", 0))
        seed = seed_formula(layout, p, n)
        vs_seed = max(peak) if layout == "zero2" else max(rest)  # the seed's ZeRO-2 keeps parameters gathered

        print(
            f"{layout:7s} {n:2d} {top(ranks, 'params')} {top(ranks, 'grads')} {top(ranks, 'optim')} "
            f"{top(ranks, 'buckets')} "
            f"{max(rest) / MIB:6.2f} {f_rest / MIB:7.2f} {max(rest) / f_rest:5.3f} {top(ranks, 'gathered')} "
            f"{max(peak) / MIB:6.2f} {f_peak / MIB:7.2f} {max(peak) / f_peak:5.3f} {seed / MIB:6.2f} "
            f"{vs_seed / seed:6.3f}"
        )
        out_runs.append(
            {
                "layout": layout,
                "n": n,
                "threads": r["threads"],
                "accum": r["accum"],
                "tokens_per_s": round(r["tokens_per_s"], 1),
                "speedup": None if r["speedup"] is None else round(r["speedup"], 3),
                "step_s": round(r["step_s"], 4),
                "others_cores": r["others_cores"],
                "rest_bytes_max": max(rest),
                "peak_bytes_max": max(peak),
                "formula_rest": f_rest,
                "formula_peak": f_peak,
                "seed_formula": seed,
                "ratio_rest": round(max(rest) / f_rest, 4),
                "ratio_peak": round(max(peak) / f_peak, 4),
                "ratio_seed": round(vs_seed / seed, 4),
                "ranks": [
                    {k: v for k, v in q.items() if k != "times"}
                    | {"step_s_median": statistics.median(q["times"])}
                    for q in ranks
                ],
                "wall_s": r["wall_s"],
            }
        )
    if not_measured:
        print("not measured: " + ", ".join(not_measured) + " (no lmforge.optim.build.build_zero_optimizer)")
    print(
        json.dumps(
            {
                "params": p,
                "precision": first["precision"],
                "tokens_per_step": first["tokens_per_step"],
                "cores": cores,
                "steps": args.steps,
                "warmup": args.warmup,
                "not_measured": not_measured,
                "runs": out_runs,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--procs", default="1,2,4", help="process counts, comma-separated")
    ap.add_argument(
        "--layouts", default="ddp,zero1,zero2,zero3", help="comma-separated: " + ", ".join(LAYOUTS)
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="threads per process (default: cores // N, at least 1)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args()
    if args.worker:
        worker(args, extra)
    else:
        driver(args, extra)


if __name__ == "__main__":
    main()
