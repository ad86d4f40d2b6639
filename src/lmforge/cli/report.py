"""``lmforge plot`` and ``lmforge compare``: run folders read back for people (``report/``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lmforge.errors import UserError


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot",
        help="PNG dashboard of one or several runs (loss, lr, norms, throughput...)",
        description="Draw the metrics of runs (overlaid, one colour per run): OUT/dashboard.png with every "
        "panel some run has data for, and OUT/<panel>.png for each. Default OUT: RUN/plots for one run, "
        "./plots for several.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--out", help="output folder (default: RUN/plots, or ./plots for several runs)")
    p.add_argument("--dashboard-only", action="store_true", help="write dashboard.png only")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser(
        "compare",
        help="runs side by side: losses, tokens, time, and the config keys that differ",
        description="Per run: status, steps, final and best validation loss, tokens seen, wall time, mean "
        "tokens/s, parameters; then every config key whose value differs between the runs.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_compare)


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.report.plots import select_panels, write_dashboard
    from lmforge.report.runs import open_run

    runs = [open_run(r) for r in args.runs]
    out = Path(args.out) if args.out else (runs[0].path / "plots" if len(runs) == 1 else Path("plots"))
    written = write_dashboard(runs, out, per_panel=not args.dashboard_only)
    if not written:
        raise UserError(f"RUN: {', '.join(args.runs)}: no metrics to draw yet (metrics.jsonl has no records)")
    events = sum(len(r.events()) for r in runs)
    print(f"{written[0]}: {', '.join(p.name for p in select_panels(runs))}; {events} events marked")
    if len(written) > 1:
        print(f"one PNG per panel beside it in {out}")
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.report.compare import compare, table_text
    from lmforge.report.runs import open_run

    result = compare([open_run(r) for r in args.runs])
    print(json.dumps(result) if args.json else table_text(result))
    return 0
