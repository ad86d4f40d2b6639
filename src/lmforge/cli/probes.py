"""``lmforge plot-schedule``, ``lr-find`` and ``mup-check``: short probes of a recipe before a run
(``report/charts.py``, ``probes/``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lmforge.errors import UserError
from lmforge.recipe import load_config, parse_overrides


def add_commands(sub: argparse._SubParsersAction) -> None:
    """``plot-schedule``, ``lr-find`` and ``mup-check``: short probes of a recipe before a run."""
    recipe_help = "TOML recipe (default: the built-in defaults); then --SECTION.KEY=VALUE overrides"
    p = sub.add_parser(
        "plot-schedule",
        help="plot a recipe's learning rate over the run",
        description="Draw the learning rate of every step (PNG) and write the values beside it (JSON).",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--out", default="schedule.png", help="PNG file (values go to the same name .json)")
    p.set_defaults(func=cmd_plot_schedule, overrides=True)

    p = sub.add_parser(
        "lr-find",
        help="learning-rate sweep: plot and suggestion",
        description="Train lr_find.steps steps at geometrically growing learning rates (lr_find.start_lr "
        "to lr_find.end_lr), smooth the loss, stop on divergence, suggest the rate where the smoothed "
        "loss falls fastest. Writes only DIR/lr_find.png and DIR/lr_find.json.",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--out", default="lr_find", help="output folder (default: lr_find)")
    p.set_defaults(func=cmd_lr_find, overrides=True)

    p = sub.add_parser(
        "mup-check",
        help="muP coordinate check: activation size against width, muP and standard",
        description="Train a few steps at several widths under the standard parametrisation and under muP "
        "and record the mean |activation| per layer. Use a small depth and short sequences "
        "(e.g. --model.n_layers=2 --data.seq_len=64).",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--widths", default="64,128,256,512", help="comma-separated d_model values")
    p.add_argument("--steps", type=int, default=10, help="training steps per model")
    p.add_argument("--out", default="mup_check", help="output folder (default: mup_check)")
    p.set_defaults(func=cmd_mup_check, overrides=True)


def cmd_plot_schedule(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.report.charts import write_schedule

    cfg = load_config(args.recipe, parse_overrides(extra))
    out = Path(args.out)
    lrs = write_schedule(cfg, out)
    print(
        f"{out} (values: {out.with_suffix('.json')}): {cfg.schedule.name}, {len(lrs)} steps, "
        f"lr {lrs[0]:.3g} at step 0, peak {max(lrs):.3g}, {lrs[-1]:.3g} at the last step"
    )
    return 0


def cmd_lr_find(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.probes.lr_find import run_lr_find

    cfg = load_config(args.recipe, parse_overrides(extra))
    out = Path(args.out)
    result = run_lr_find(cfg, out)
    s = result.suggestion
    end = f"diverged at lr {result.stop_lr:.3g}" if result.stopped_early else "reached lr_find.end_lr"
    print(f"swept {len(result.lrs)} steps from {result.lrs[0]:.3g} to {result.lrs[-1]:.3g} ({end})")
    print(f"smoothed loss minimum at lr {s.min_lr:.3g} (min / 10: {s.min_over_10:.3g})")
    print(f"suggested lr (steepest descent of the smoothed loss): {s.lr:.3g}  -> --optim.lr={s.lr:.3g}")
    print(f"wrote {out / 'lr_find.png'} and {out / 'lr_find.json'}")
    return 0


def cmd_mup_check(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.probes.mup_check import run_mup_check, spread

    cfg = load_config(args.recipe, parse_overrides(extra))
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise UserError(f"--widths: {args.widths!r} is not a comma-separated list of integers") from None
    out = Path(args.out)
    check = run_mup_check(cfg, widths, args.steps, out)
    print(
        f"mean |activation| after {check.steps} steps at lr {check.lr:g} "
        f"(muP base width {check.base_width}); spread = largest / smallest over widths {check.widths}"
    )
    for param in check.sizes:
        print(f"{param}:")
        for w in check.widths:
            sizes = check.sizes[param][w]
            print(f"  width {w:>5}: " + "  ".join(f"{k} {v[-1]:.3g}" for k, v in sizes.items()))
        print("  spread:      " + "  ".join(f"{k} {v:.2f}x" for k, v in spread(check, param).items()))
    print(f"wrote {out / 'mup_check.png'} and {out / 'mup_check.json'}")
    return 0
