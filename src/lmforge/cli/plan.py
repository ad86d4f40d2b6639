"""``lmforge estimate``: memory, time and communication of a layout before running it
(``plan/request.py``, the computation the web planners share); this module formats its result."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30


def add_commands(sub: argparse._SubParsersAction) -> None:
    recipe_help = "TOML recipe (default: the built-in defaults); then --SECTION.KEY=VALUE overrides"
    p = sub.add_parser(
        "estimate",
        help="memory, time and communication of a layout before running it",
        description="Per device: parameters, gradients, optimizer states, master weights, activations, "
        "temporary buffers and overhead, whether that fits under --margin of the device's memory; FLOPs, "
        "step time at --mfu, tokens/day, communication, pipeline bubble, days to Chinchilla's 20 N tokens. "
        "Formulas: lmforge/plan/ and docs/memory.md.",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument(
        "--model",
        help="a named size (its model, vocab and seq_len under the overrides): "
        "gpt2-124m, llama-1b, llama-7b, llama-13b, llama-65b, llama-70b, gpt3-175b",
    )
    p.add_argument("--gpu", default="h100-80gb", help="h100-80gb, h200, a100-80gb, a100-40gb or cpu")
    p.add_argument("--gpus", type=int, default=1, help="devices (with every parallel degree 1: all shard)")
    p.add_argument(
        "--weights",
        choices=["lmforge", "zero-paper"],
        default="lmforge",
        help="accounting: lmforge (FP32 params = master, FP32 grads) or zero-paper (2+2+4+K)",
    )
    p.add_argument("--search", action="store_true", help="also list the layouts that fit, fastest first")
    p.add_argument("--top", type=int, default=10, help="layouts --search lists (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--plot", metavar="PNG", help="stacked bar chart of the breakdown (one bar per layout)")
    p.add_argument("--margin", type=float, default=0.8, help="fits below this share of memory (0.8)")
    p.add_argument("--mfu", type=float, default=0.4, help="model-FLOPs utilisation assumed (0.4)")
    p.add_argument(
        "--attention",
        choices=["flash", "flex", "math"],
        default=None,
        help="what attention saves: flash / flex O(T), math T x T (default: what train.attention picks there)",
    )
    p.set_defaults(func=cmd_estimate, overrides=True)


def cmd_estimate(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.plan.request import EstimateRequest, run_estimate

    req = EstimateRequest(
        args.recipe,
        args.model,
        args.gpu,
        args.gpus,
        args.weights,
        args.search,
        args.top,
        args.margin,
        args.mfu,
        args.attention,
        tuple(extra),
    )
    result = run_estimate(req)
    est, found, more, hw, workload = result.estimate, result.found, result.more, result.hw, result.workload
    name = result.name
    if args.json:
        print(json.dumps(result.to_json(args.search)))
    else:
        print(_estimate_text(est, name, workload.optimizer, hw))
        if args.search:
            print(_search_text(found, args.gpus, hw, more))
        elif not est.fits:
            print("does not fit: lmforge estimate ... --search lists the layouts that do, fastest first")
    if args.plot:
        from lmforge.report.charts import estimate_chart

        estimate_chart(result, Path(args.plot), args.gpus, args.margin, args.weights)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _estimate_text(e, name: str, optimizer: str, hw) -> str:
    t, c = e.temporaries, e.comm
    temps = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in e.temporaries_alive.items())
    acts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in e.activation_parts.items() if v)
    # buffers the forward made, alive at the peak: activations as PyTorch's trackers count them
    acts += "".join(f", {k.replace('_', ' ')} {v / GIB:.2f}" for k, v in e.forward_buffers_alive.items())
    limit = e.margin * e.memory_bytes
    lines = [
        f"{name}: {e.n_params:,} parameters ({e.n_params / 1e9:.2f}B)"
        + (
            f", {e.active_params:,} active per token ({e.active_params / 1e9:.2f}B)"
            if e.active_params != e.n_params
            else ""
        )
        + f"; {e.layout.world} x {hw.name} "
        f"({e.memory_bytes / GIB:.1f} GiB each); {e.precision}, {optimizer}, {e.attention} attention; "
        f"{e.accounting} accounting",
        f"layout: {e.layout.describe()}; {e.tokens_per_step:,} tokens per step ({e.accum} micro-batch{'es' if e.accum > 1 else ''} per rank)",
        f"per device (pipeline rank {e.pp_rank}: {e.device_params / 1e9:.2f}B parameters after TP/PP, before "
        "data-parallel sharding)        GiB",
    ]
    lines.append(f"  peak: {e.peak_phase}")
    grads_note = (
        ""
        if e.gradients_at_peak == e.states.grads
        else f"unsharded while micro-batches accumulate; {e.states.grads / GIB:.2f} GiB reduce-scattered"
        if e.gradients_at_peak > e.states.grads
        else f"{e.states.grads / GIB:.2f} GiB by the end of backward"
    )
    acts_note = (
        acts
        if e.activations_at_peak >= e.activations
        else f"{e.activations / GIB:.2f} GiB saved by the end of forward, the rest freed by this phase: {acts}"
    )
    for row, value in e.rows().items():
        detail = {
            "gradients": grads_note,
            "activations": acts_note,
            "temporaries": temps,
            "overhead": f"{e.overhead_runtime / GIB:.1f} GiB runtime + {e.overhead_fraction:.0%} of the rest, assumed",
        }.get(row, "")
        lines.append(f"  {row:<18s} {value / GIB:10.2f}" + (f"   ({detail})" if detail else ""))
    if t.optimizer_step:
        lines.append(
            f"  (optimizer step scratch {t.optimizer_step / GIB:.2f} GiB, after the activations are freed)"
        )
    verdict = (
        f"{'fits' if e.fits else 'DOES NOT FIT'}: {e.peak / e.memory_bytes:.0%} of the device; limit "
        f"{e.margin:.0%} = {limit / GIB:.1f} GiB (Fujii et al. 2024: no OOM in 454 runs under 80%)"
    )
    b = e.build
    build = (
        f"initialising: FP32 parameters {b.shards / GIB:.2f}"
        + (
            f" + the largest whole parameter {b.temporary / GIB:.2f}"
            if b.temporary
            else " (each initialised in place)"
        )
        + (f" + DDP buckets {b.ddp_buckets / GIB:.2f}" if b.ddp_buckets else "")
        + f" + overhead {e.build_overhead / GIB:.2f}"
        + (f", pipeline rank {e.build_pp_rank}" if e.layout.pp > 1 else "")
    )
    step_peak = e.peak_source == "step"
    lines.append(f"  {'total':<18s} {e.total / GIB:10.2f}   " + (verdict if step_peak else "(training step)"))
    lines.append(
        f"  {'build':<18s} {e.build_total / GIB:10.2f}   ({build})" + ("" if step_peak else f"; {verdict}")
    )
    if len(e.pp_rank_totals) > 1:
        lines.append(
            "  per pipeline rank: "
            + ", ".join(f"{r}: {t / GIB:.2f}" for r, t in enumerate(e.pp_rank_totals))
            + " GiB; build "
            + ", ".join(f"{r}: {t / GIB:.2f}" for r, t in enumerate(e.pp_rank_build_totals))
            + " GiB"
        )
    lines += [
        f"compute: {e.flops_per_token / 1e9:.1f} GFLOP per token (6N + 12 L d T"
        + (", N the active parameters" if e.active_params != e.n_params else "")
        + f"), {e.flops_per_step / 1e15:.2f} PFLOP "
        f"per step; recompute x{e.recompute:.2f}, pipeline bubble {e.bubble:.1%} ((p-1)/(m+p-1))",
        f"time at MFU {e.mfu:.2f}: step {e.step_s:.3f} s (compute {e.compute_s:.3f} s, exposed communication "
        f"{e.exposed_comm_s:.3f} s), {e.tokens_per_s:,.0f} tokens/s, {e.tokens_per_day / 1e9:.2f}B tokens/day",
        f"communication per step and device: data parallel {c.dp / GIB:.2f} GiB, tensor parallel {c.tp / GIB:.2f} GiB, "
        f"pipeline {c.pp / GIB:.2f} GiB"
        + (f", expert all-to-all {c.ep / GIB:.2f} GiB (balanced router)" if e.layout.ep > 1 else ""),
        f"Chinchilla (D = 20 N): {e.chinchilla_tokens / 1e9:.1f}B tokens in {e.chinchilla_days:.1f} days at this rate",
    ]
    lines += [f"warning: {w}" for w in e.warnings]
    return "\n".join(lines)


def _search_text(found: list, gpus: int, hw, more=None) -> str:
    if not found:
        text = f"\nsearch: no layout of {gpus} x {hw.name} fits"
        if more is None:
            return text + " (nor on up to 4096 devices)"
        n, e = more
        return (
            f"{text}; the fewest devices (doubling) on which one does: {n} x {hw.name}, fastest: "
            f"{e.layout.describe()}, {e.total / GIB:.2f} GiB per device, {e.tokens_per_s:,.0f} tokens/s"
        )
    lines = [
        f"\nlayouts that fit on {gpus} x {hw.name}, fastest first:",
        f"  {'#':>2s}  {'layout':<42s} {'GiB':>7s} {'tokens/s':>11s} {'step s':>7s} {'days 20N':>8s}",
    ]
    for i, e in enumerate(found, 1):
        lines.append(
            f"  {i:2d}  {e.layout.describe():<42s} {e.total / GIB:7.2f} {e.tokens_per_s:11,.0f} {e.step_s:7.3f} {e.chinchilla_days:8.1f}"
        )
    return "\n".join(lines)
