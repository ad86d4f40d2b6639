"""``lmforge dashboard``: the local web app over a runs folder (``web/``), served until Ctrl-C."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard",
        help="local web app: live training dashboard and interactive planners (docs/visual-tools.md)",
        description="Serve RUNS_DIR read-only on a local address: the runs with live curves, events, overlays "
        "and config differences, and the planners (memory, checkpointing, ZeRO, parallelism, schedules, "
        "optimizers, cleaning trade-off), every figure computed by lmforge's own code.",
    )
    p.add_argument(
        "runs_dir", nargs="?", default="runs", metavar="RUNS_DIR", help="runs folder (default: runs)"
    )
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--poll-ms", type=int, default=1000, help="how often pages poll running runs (ms)")
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.web.app import create_app
    from lmforge.web.server import bind, url_of

    server = bind(create_app(Path(args.runs_dir), args.poll_ms), args.host, args.port)
    print(
        f"lmforge dashboard: {Path(args.runs_dir).resolve()} (read-only) at {url_of(server)}; Ctrl-C stops",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
