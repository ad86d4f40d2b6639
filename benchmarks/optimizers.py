"""AdamW, Lion and Muon at equal steps on the built-in corpus, and the optimizer-state bytes of AdamW8bit.

Each optimizer trains the same small Llama-style model from the same initialisation on the same batches
(``builtin:pystdlib``, the same seed) for the same number of steps with the same schedule (linear warmup,
cosine to 10%), through lmforge's own training loop. Validation loss is measured every ``--eval-every``
steps on the same held-out tokens. Printed: each optimizer's final validation loss, and how many steps
Muon needs to reach AdamW's final loss (linear interpolation between the two evaluations of Muon's curve
that straddle it) as a fraction of AdamW's steps. Note that Muon's curve at an intermediate step is
measured under a cosine schedule stretched over the whole run, so the ratio is conservative compared with
a Muon run scheduled to end there.

Learning rates (peak): AdamW ``--adamw-lr`` (3e-3, the recipe default), Lion ``--lion-lr`` (1e-3, ~3x
lower as its sign update has RMS 1), Muon ``--muon-lr`` (0.02 with the ``original`` scale
max(1, d_out/d_in)^0.5) on the hidden matrices, AdamW at ``--adamw-lr`` for the embeddings and norms.
All with weight decay 0.1 on matrices, betas (0.9, 0.95), gradient clipping at 1.0, FP32.

The state size is measured, not computed: the bytes of every tensor in ``optimizer.state`` after one step
(torchao's 8-bit state counted as its uint8 codes plus FP32 block scales), over the number of parameters,
for the benchmark's model and for the default recipe's model.

    python benchmarks/optimizers.py [--steps 300] [--d-model 128] [--n-layers 4] [--SECTION.KEY=VALUE ...]

Wall times are printed for orientation only (shared CPUs make them noisy). The last line printed is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

from lmforge.config import Config, ModelConfig, OptimConfig
from lmforge.experiment.results import steps_to_reach
from lmforge.model.loss import NextTokenLoss
from lmforge.optim.build import build_optimizer
from lmforge.optim.state_size import state_bytes_per_param
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.build import build_model
from lmforge.train.launch import train


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, val_loss) pairs from a run's ``metrics.jsonl``, in step order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r)


def state_bytes_after_one_step(model_cfg: ModelConfig, vocab: int, name: str) -> float:
    """Optimizer-state bytes per parameter of ``name`` on this model after one step on random tokens."""
    cfg = Config(model=model_cfg, data={"seq_len": 64}, optim=OptimConfig(name=name), train={"seed": 0})
    model = build_model(cfg, vocab, torch.device("cpu"))
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"), compile=False)
    x = torch.randint(0, vocab, (2, 64))
    s, n = NextTokenLoss(model)(x, x)
    (s / n).backward()
    for g in opt.param_groups:
        g["lr"] = 1e-3 * g["lr_mult"]
    opt.step()
    return state_bytes_per_param(opt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps of every optimizer")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--eval-every", type=int, default=20, help="steps between validation evaluations")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--lion-lr", type=float, default=1e-3)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--muon-scale", default="original", choices=["none", "original", "mup", "moonlight"])
    ap.add_argument("--optimizers", default="adamw,lion,muon", help="comma-separated; adamw8bit may be added")
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    ap.add_argument("--run-root", default=None, help="keep the runs here (default: a temporary folder)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)

    base = {
        "data.cache_dir": args.cache_dir,
        "data.seq_len": args.seq_len,
        "model.d_model": args.d_model,
        "model.n_layers": args.n_layers,
        "model.n_heads": args.n_heads,
        "train.steps": args.steps,
        "train.micro_batch_size": args.batch,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": args.eval_every,
        "train.eval_tokens": args.eval_tokens,
        "train.checkpoint_interval": 0,
        "train.log_interval": max(1, args.steps // 10),
        "train.sample_tokens": 0,
        "schedule.name": "cosine",
        "schedule.warmup": 0.1,
        "optim.lr": args.adamw_lr,
        **parse_overrides(extra),
    }
    per_opt = {
        "adamw": {"optim.name": "adamw"},
        "adamw8bit": {"optim.name": "adamw8bit"},
        "lion": {"optim.name": "lion", "optim.lr": args.lion_lr},
        "muon": {"optim.name": "muon", "optim.muon.lr": args.muon_lr, "optim.muon.scale": args.muon_scale},
    }
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in per_opt]
    if unknown:
        ap.error(f"--optimizers: unknown {', '.join(unknown)}; choose from {', '.join(per_opt)}")

    root = Path(args.run_root) if args.run_root else Path(tempfile.mkdtemp(prefix="lmforge-optim-"))
    results: dict[str, dict] = {}
    for name in names:
        cfg = load_config(None, {**base, **per_opt[name]})
        run_dir = root / name
        t0 = time.perf_counter()
        summary = train(cfg, run_dir, progress_bar=False)
        wall = time.perf_counter() - t0
        curve = val_curve(run_dir)
        results[name] = {
            "lr": cfg.optim.lr,
            **({"muon_lr": args.muon_lr, "muon_scale": args.muon_scale} if name == "muon" else {}),
            "final_val_loss": summary["val_loss"],
            "wall_s": round(wall, 1),
            "curve": curve,
        }
        print(
            f"{name:10s} lr {cfg.optim.lr:g}"
            + (f" (muon_lr {args.muon_lr:g}, scale {args.muon_scale})" if name == "muon" else "")
            + f": final val_loss {summary['val_loss']:.4f} after {summary['step']} steps"
            f" ({summary['tokens_seen']:,} tokens, {summary['parameters'] / 1e6:.2f}M parameters), {wall:.0f}s",
            flush=True,
        )
        print("  curve: " + ", ".join(f"{s}:{v:.3f}" for s, v in curve), flush=True)

    out: dict = {
        "steps": args.steps,
        "model": {"d_model": args.d_model, "n_layers": args.n_layers, "seq_len": args.seq_len},
        "final_val_loss": {n: round(r["final_val_loss"], 4) for n, r in results.items()},
        "lr": {n: r["lr"] for n, r in results.items()},
        "wall_s": {n: r["wall_s"] for n, r in results.items()},
    }
    if "muon" in results:
        out["muon_lr"], out["muon_scale"] = args.muon_lr, args.muon_scale
    if "adamw" in results and "muon" in results:
        target = results["adamw"]["final_val_loss"]
        reach = steps_to_reach(results["muon"]["curve"], target)
        if reach is None:
            print(f"muon never reached AdamW's final val_loss {target:.4f} in {args.steps} steps")
            out["muon_steps_to_adamw_loss"] = None
            out["muon_step_ratio"] = None
        else:
            ratio = reach / args.steps
            print(
                f"muon reached AdamW's final val_loss {target:.4f} at step {reach:.0f} "
                f"(interpolated): {ratio:.2f}x AdamW's {args.steps} steps"
            )
            out["muon_steps_to_adamw_loss"] = round(reach, 1)
            out["muon_step_ratio"] = round(ratio, 3)

    n_vocab = load_config(None, base).data.vocab_size
    shapes = {
        "benchmark": ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads),
        "default": ModelConfig(),
    }
    state = {}
    for label, mcfg in shapes.items():
        state[label] = {
            n: round(state_bytes_after_one_step(mcfg, n_vocab, n), 3) for n in ("adamw", "adamw8bit")
        }
        print(
            f"optimizer state, {label} model: adamw {state[label]['adamw']:.3f} bytes/param, "
            f"adamw8bit {state[label]['adamw8bit']:.3f} bytes/param "
            f"({state[label]['adamw'] / state[label]['adamw8bit']:.2f}x smaller)"
        )
    out["state_bytes_per_param"] = state
    print(json.dumps(out))


if __name__ == "__main__":
    main()
