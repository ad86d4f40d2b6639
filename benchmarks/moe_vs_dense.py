"""An 8-expert top-2 mixture of experts against the dense model with the same active parameters, over seeds.

Both models are the same small Llama-style network (``--n-layers`` blocks of width ``--d-model``) on the
built-in corpus, trained through lmforge's own loop with the same batches, steps, schedule and optimizer.
The dense model's blocks have one SwiGLU MLP of ``--d-ff`` hidden units; the MoE model replaces every
block's MLP by ``--experts`` routed SwiGLU experts of ``d_expert = d_ff / top_k`` hidden units,
``--top-k`` of them per token. So a token goes through
``top_k x 3 x d_model x d_expert = 3 x d_model x d_ff`` expert weights, exactly the dense MLP's count:
the same active parameters and the same matrix FLOPs per token, plus the router's ``d_model x experts``
per block (under 1% of a block here). The MoE model holds ``experts / top_k`` times the MLP parameters.

Routing: sigmoid scores, top-k normalised, auxiliary-loss-free balancing (bias rate ``1e-3``) with a
light Switch loss and z-loss (``1e-3`` each), as ``configs/moe.toml``; dropless.

Each seed (``train.seed``: initialisation and data order) trains both models, dense first, then MoE, so
that the machine's load falls on both alike. Printed: each run's final validation loss (the same held-out
tokens for all) and training wall time; then per model the mean and the sample standard deviation over
seeds, the MoE-minus-dense difference of each seed with its mean and spread, and the wall-time ratio
MoE / dense measured in this run, and a two-sided Welch t-test of the two models' final validation losses
(``lmforge.experiment.stats.welch_test``). The last line printed is one JSON object.

    python benchmarks/moe_vs_dense.py [--seeds 1,2,3] [--steps 300] [--SECTION.KEY=VALUE ...]

The CPU wall time counts what a CPU does: the routed experts run as one grouped matrix product each
(``torch._grouped_mm``, or a loop), plus the routing, sorting and scatter a dense MLP does not have.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

from lmforge.experiment.stats import welch_test
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.launch import train


def spread(values: list[float]) -> tuple[float, float]:
    """``(mean, s)``: the mean and the sample standard deviation ``sqrt(sum (x - mean)^2 / (n - 1))``
    (0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def moe_overrides(d_ff: int, experts: int, top_k: int) -> dict:
    """The MoE model's overrides: every block's MLP replaced by ``experts`` experts of ``d_ff / top_k``
    hidden units, ``top_k`` per token (the dense MLP's active parameters)."""
    if d_ff % top_k:
        raise SystemExit(f"--d-ff {d_ff} is not divisible by --top-k {top_k}; choose a multiple")
    return {
        "model.moe.experts": experts,
        "model.moe.top_k": top_k,
        "model.moe.d_expert": d_ff // top_k,
        "model.moe.score": "sigmoid",
        "model.moe.aux_loss": 1e-3,
        "model.moe.z_loss": 1e-3,
        "model.moe.bias_update_rate": 1e-3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-ff", type=int, default=384, help="the dense MLP's hidden units")
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    ap.add_argument("--run-root", default=None, help="keep the runs here (default: a temporary folder)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = {
        "data.cache_dir": args.cache_dir,
        "data.seq_len": args.seq_len,
        "model.d_model": args.d_model,
        "model.d_ff": args.d_ff,
        "model.n_layers": args.n_layers,
        "model.n_heads": args.n_heads,
        "train.steps": args.steps,
        "train.micro_batch_size": args.batch,
        "train.tokens_per_step": args.batch * args.seq_len,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": args.steps,
        "train.eval_tokens": args.eval_tokens,
        "train.checkpoint_interval": 0,
        "train.log_interval": max(1, args.steps // 10),
        "train.sample_tokens": 0,
        **parse_overrides(extra),
    }
    models = {"dense": {}, "moe": moe_overrides(args.d_ff, args.experts, args.top_k)}
    root = Path(args.run_root) if args.run_root else Path(tempfile.mkdtemp(prefix="lmforge-moe-"))
    runs: dict[str, dict[int, dict]] = {name: {} for name in models}
    for seed in seeds:
        for name, over in models.items():
            cfg = load_config(None, {**base, **over, "train.seed": seed})
            t0 = time.perf_counter()
            summary = train(cfg, root / f"{name}-{seed}", progress_bar=False)
            wall = time.perf_counter() - t0
            runs[name][seed] = {
                "val_loss": summary["val_loss"],
                "wall_s": wall,
                "parameters": summary["parameters"],
            }
            print(
                f"seed {seed} {name:5s}: val_loss {summary['val_loss']:.4f}, {summary['parameters'] / 1e6:.2f}M "
                f"parameters, {summary['tokens_seen']:,} tokens, {wall:.0f} s",
                flush=True,
            )
    out: dict = {"steps": args.steps, "seeds": seeds, "experts": args.experts, "top_k": args.top_k}
    for name in models:
        mean, s = spread([runs[name][seed]["val_loss"] for seed in seeds])
        wall, wall_sd = spread([runs[name][seed]["wall_s"] for seed in seeds])
        params = runs[name][seeds[0]]["parameters"]
        print(
            f"{name:5s}: val_loss {mean:.4f} +- {s:.4f} (n={len(seeds)}), {params / 1e6:.2f}M parameters, "
            f"training {wall:.0f} +- {wall_sd:.0f} s"
        )
        out[name] = {
            "val_loss_mean": mean,
            "val_loss_sd": s,
            "wall_s_mean": wall,
            "wall_s_sd": wall_sd,
            "parameters": params,
        }
    diffs = [runs["moe"][seed]["val_loss"] - runs["dense"][seed]["val_loss"] for seed in seeds]
    welch = welch_test(
        [runs["dense"][s]["val_loss"] for s in seeds], [runs["moe"][s]["val_loss"] for s in seeds]
    )
    d_mean, d_sd = spread(diffs)
    ratio = out["moe"]["wall_s_mean"] / out["dense"]["wall_s_mean"]
    print(
        f"moe - dense val_loss per seed: {', '.join(f'{d:+.4f}' for d in diffs)}; mean {d_mean:+.4f} +- {d_sd:.4f}"
    )
    p = "n/a (fewer than 2 seeds)" if welch.p is None else f"{welch.p:.3g}"
    print(f"Welch's t-test, moe against dense val_loss: p = {p}")
    print(f"wall time moe / dense: {ratio:.2f}x (measured in this run, same machine and load)")
    out.update(
        {"diff_mean": d_mean, "diff_sd": d_sd, "diffs": diffs, "welch_p": welch.p, "wall_ratio": ratio}
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
