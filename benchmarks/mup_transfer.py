"""muP learning-rate transfer: does the best learning rate at width 64 stay the best at widths 256 and 512?

Under muP (``model.mup = true``, base width 64: ``model/init.py``) the hidden matrices' Adam rate is
``lr x 64 / d_model``, their init ``std / sqrt(d_model / 64)`` and the logits ``x 64 / d_model``, so that
one ``optim.lr`` is meant to be right at every width (Yang et al. 2022). This runs the grid of widths x
learning rates over seeds through lmforge's experiment machinery (``experiment/``: interleaved seeds,
finished runs skipped, ``results.md`` against the first arm) on ``configs/experiment-small.toml`` with a
1,024-token vocabulary, 200 steps of 8 x 64 tokens (102K tokens), then per width: the mean and spread of
the final validation loss at each rate, the best rate, how many seeds put their minimum at it, and the
Welch test of the best rate against the runner-up (``experiment/stats.py``). Writes ``OUT/mup_transfer.json``
and ``OUT/mup_transfer.png`` (loss against rate, one curve per width, +- one sd).

    python benchmarks/mup_transfer.py --out DIR [--seeds 3] [--widths 64,256,512] [--lrs 1e-3,3e-3,1e-2,3e-2]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from lmforge.experiment.plan import make_plan
from lmforge.experiment.results import write_results
from lmforge.experiment.run import run_experiment
from lmforge.experiment.stats import mean, sample_sd, welch_test

RECIPE = str(Path(__file__).resolve().parent.parent / "configs" / "experiment-small.toml")
OVERRIDES = {
    "model.mup": True,
    "model.mup_base_width": 64,
    "data.vocab_size": 1024,
    "train.steps": 200,
    "train.micro_batch_size": 8,
    "schedule.warmup": 20,
    "train.eval_interval": 50,
    "train.checkpoint_interval": 0,
}


def per_width(finals: dict[str, list[float]], widths: list[int], lrs: list[float]) -> dict[str, dict]:
    """Per width: each rate's losses, mean and sd, the best rate (lowest mean), the seeds whose own minimum
    is at it, and the Welch test of the best against the runner-up."""
    out = {}
    for w in widths:
        losses = {lr: finals[f"model.d_model={w}__optim.lr={lr}"] for lr in lrs}
        ranked = sorted(lrs, key=lambda lr: mean(losses[lr]))
        best, second = ranked[0], ranked[1]
        seeds = len(losses[best])
        at_best = sum(min(lrs, key=lambda lr, i=i: losses[lr][i]) == best for i in range(seeds))
        test = welch_test(losses[second], losses[best])
        out[str(w)] = {
            "losses": {str(lr): losses[lr] for lr in lrs},
            "mean": {str(lr): mean(losses[lr]) for lr in lrs},
            "sd": {str(lr): sample_sd(losses[lr]) for lr in lrs},
            "best_lr": best,
            "seeds_with_minimum_at_best": f"{at_best} of {seeds}",
            "runner_up": second,
            "best_vs_runner_up": {"diff": test.diff, "p": test.p},  # best minus runner-up
        }
    return out


def chart(res: dict[str, dict], lrs: list[float], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot(1, 1, 1)
    for w, r in res.items():
        means = [r["mean"][str(lr)] for lr in lrs]
        sds = [r["sd"][str(lr)] for lr in lrs]
        ax.errorbar(lrs, means, yerr=sds, marker="o", capsize=3, label=f"d_model {w}")
    ax.set_xscale("log")
    ax.set_xlabel("optim.lr (muP, base width 64)")
    ax.set_ylabel("final validation loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--widths", default="64,256,512")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("lmforge.experiment").setLevel(logging.INFO)  # "run i/N: ARM seed S" per run
    vary = [f"model.d_model={args.widths}", f"optim.lr={args.lrs}"]
    plan = make_plan(RECIPE, vary, args.seeds, ["val_loss"], dict(OVERRIDES), out=args.out)
    run_experiment(plan)
    command = f"python benchmarks/mup_transfer.py --out {args.out} --seeds {args.seeds}"
    res = write_results(plan, command)
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    table = per_width(res["final_losses"], widths, lrs)
    (args.out / "mup_transfer.json").write_text(json.dumps(table, indent=1))
    chart(table, lrs, args.out / "mup_transfer.png")
    for w, r in table.items():
        cells = ", ".join(f"{lr}: {r['mean'][lr]:.3f} +- {r['sd'][lr]:.3f}" for lr in r["mean"])
        print(
            f"d_model {w}: {cells}; best {r['best_lr']} ({r['seeds_with_minimum_at_best']} seeds), "
            f"vs {r['runner_up']}: {r['best_vs_runner_up']['diff']:+.3f}, p = {r['best_vs_runner_up']['p']:.3g}"
        )


if __name__ == "__main__":
    main()
