"""``lmforge plot``: dashboards of one or several runs (matplotlib, Agg canvas, no pyplot state).

A panel is drawn when at least one run has one of its keys (:func:`select_panels`); several runs are
overlaid, one colour per run, named by their folder. The loss panel marks the runs' events (guard skips,
rollbacks, loss-scale overflows, early stop...) with a vertical line and a marker per event kind.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from lmforge.report.runs import RunRecords


@dataclass(frozen=True)
class Curve:
    """One key of one record kind; ``{i}`` / ``{kind}`` in ``key`` stand for a layer index / a name and
    give one curve per matching key (``attn_entropy/layer.{i}``); ``{score}`` stands for a task's
    ``<name>/<metric>`` (its ``_stderr`` key left out)."""

    kind: str
    key: str
    label: str
    right: bool = False  # on a second y axis (its own scale)
    style: str = "-"


@dataclass(frozen=True)
class Panel:
    name: str  # file name of the panel's own PNG
    title: str
    ylabel: str
    curves: tuple[Curve, ...]
    log: bool = False
    right_label: str = ""
    events: bool = False  # mark the runs' events here


PANELS = (
    Panel(
        "loss",
        "loss",
        "nats per token",
        (Curve("step", "loss", "train"), Curve("eval", "val_loss", "validation", style="o-")),
        events=True,
    ),
    Panel("lr", "learning rate", "lr", (Curve("step", "lr", "lr"),)),
    Panel(
        "norms",
        "gradient and parameter norms",
        "L2 norm",
        (Curve("step", "grad_norm", "gradient"), Curve("detail", "param_norm", "parameters", style="--")),
        log=True,
    ),
    Panel(
        "grad_norm_by_kind",
        "gradient norm per parameter kind",
        "L2 norm",
        (Curve("detail", "grad_norm/{kind}", "{kind}"),),
        log=True,
    ),
    Panel(
        "update_ratio",
        "update ratio |step| / |parameters|",
        "ratio",
        (
            Curve("detail", "update_ratio", "all"),
            Curve("detail", "update_ratio/block.{i}", "block {i}", style=":"),
        ),
        log=True,
    ),
    Panel(
        "attn_entropy",
        "attention entropy per layer",
        "nats",
        (
            Curve("detail", "attn_entropy/layer.{i}", "layer {i}"),
            Curve("detail", "attn_entropy", "mean", style="--"),
        ),
    ),
    Panel(
        "throughput",
        "tokens/s and MFU",
        "tokens/s",
        (Curve("step", "tokens_per_s", "tokens/s"), Curve("step", "mfu", "MFU", right=True, style="--")),
        right_label="MFU",
    ),
    Panel(
        "memory",
        "memory",
        "GiB",
        (
            Curve("step", "mem_peak_allocated_gib", "peak allocated"),
            Curve("step", "mem_rss_gib", "host RSS", style="--"),
        ),
    ),
    Panel(
        "data_wait",
        "share of step time waiting for data",
        "share",
        (Curve("step", "data_wait_share", "wait"),),
    ),
    Panel(
        "batch",
        "critical batch (gradient noise scale) and batch",
        "tokens",
        (
            Curve("step", "gns_critical_batch", "critical batch"),
            Curve("step", "batch_tokens", "batch", style="--"),
        ),
        log=True,
    ),
    Panel(
        "tasks",
        "downstream task scores ([eval])",
        "score",
        (Curve("task", "task/{score}", "{score}", style="o-"),),
    ),
    Panel("loss_scale", "fp16 loss scale", "scale", (Curve("step", "loss_scale", "scale"),), log=True),
    Panel(
        "moe_imbalance",
        "MoE expert load imbalance per layer",
        "max / mean tokens per expert",
        (
            Curve("step", "moe/layer.{i}/imbalance", "layer {i}"),
            Curve("step", "moe/imbalance", "worst", style="--"),
        ),
    ),
    Panel(
        "moe_balance_losses",
        "MoE balance losses (without coefficients)",
        "loss",
        (
            Curve("step", "moe/aux_loss", "aux (Switch)"),
            Curve("step", "moe/seq_aux_loss", "sequence-wise"),
            Curve("step", "moe/z_loss", "router z-loss", right=True, style="--"),
        ),
        right_label="z-loss",
    ),
)

EVENT_MARKERS = {
    "skip_nonfinite": "x",
    "skip_spike": "^",
    "rollback": "v",
    "lr_change": "D",
    "data_skip": ">",
    "loss_scale_overflow": "s",
    "early_stop": "*",
    "task_regression": "P",
}
STYLES = ("-", "--", ":", "-.")
FEW_POINTS = 20  # a series with fewer points is drawn with a marker at each (one point makes no line)


def matching_keys(curve: Curve, keys: set[str]) -> list[tuple[str, str]]:
    """``(key, label)`` of every key of ``keys`` that ``curve`` names, layers in numeric order."""
    if "{" not in curve.key:
        return [(curve.key, curve.label)] if curve.key in keys else []
    pattern = (
        re.escape(curve.key)
        .replace(r"\{i\}", r"(?P<i>\d+)")
        .replace(r"\{kind\}", r"(?P<kind>[^/.]+)")
        .replace(r"\{score\}", r"(?P<score>[^/]+/[^/]+)(?<!_stderr)")
    )
    found = []
    for key in keys:
        m = re.fullmatch(pattern, key)
        if m:
            order = int(m["i"]) if "i" in m.groupdict() else 0
            found.append((order, key, curve.label.format(**m.groupdict())))
    return [(key, label) for _, key, label in sorted(found)]


def panel_keys(panel: Panel, run: RunRecords) -> list[tuple[Curve, str, str]]:
    """``(curve, key, label)`` of each line ``run`` gives ``panel``."""
    return [(c, k, label) for c in panel.curves for k, label in matching_keys(c, run.keys(c.kind))]


def select_panels(runs: list[RunRecords]) -> list[Panel]:
    """The panels of :data:`PANELS` that at least one run has a key of, in their order."""
    return [p for p in PANELS if any(panel_keys(p, run) for run in runs)]


def draw_panel(ax: Axes, panel: Panel, runs: list[RunRecords]) -> None:
    """Draw ``panel`` for ``runs`` on ``ax``: one colour per run (a colour per line with one run and
    several lines of one curve, such as layers); legends name the run when there are several."""
    right: Axes | None = None
    several = len(runs) > 1
    for r, run in enumerate(runs):
        lines = panel_keys(panel, run)
        groups = {c: sum(1 for c2, _, _ in lines if c2 is c) for c, _, _ in lines}
        seen: dict[Curve, int] = {}
        for curve, key, label in lines:
            n = seen[curve] = seen.get(curve, -1) + 1
            steps, values = run.series(curve.kind, key)
            if not steps:
                continue
            if several:
                color = f"C{r % 10}"
                style = STYLES[n % len(STYLES)] if groups[curve] > 1 else curve.style
                label = f"{run.name}: {label}"
            else:
                color = _shade(n, groups[curve]) if groups[curve] > 1 else f"C{panel.curves.index(curve)}"
                style = curve.style
            target = ax
            if curve.right:
                right = right or ax.twinx()
                target = right
            marker = "o" if "o" in style or len(steps) < FEW_POINTS else None
            target.plot(
                steps,
                values,
                ls=style.replace("o", "") or "-",
                marker=marker,
                ms=3,
                color=color,
                label=label,
                lw=1.2,
            )
        if panel.events:
            _mark_events(ax, run, f"C{r % 10}" if several else "tab:red")
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    if panel.log and _positive(ax):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        right.set_ylabel(panel.right_label)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if panel.events:
        handles, labels = _event_legend(runs, handles, labels)
    if handles:
        ax.legend(handles, labels, fontsize=7, ncol=2 if len(handles) > 6 else 1)


def _shade(n: int, total: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["viridis"](0.9 * n / max(total - 1, 1))


def _positive(ax: Axes) -> bool:
    ys = [y for line in ax.get_lines() for y in np.asarray(line.get_ydata(), dtype=float)]
    return bool(ys) and min(ys) > 0


def _mark_events(ax: Axes, run: RunRecords, color: str) -> None:
    """A vertical line at each event's step and its kind's marker on the loss curve (the event's own loss
    where it has one: a spike's value)."""
    steps, losses = run.series("step", "loss")
    for event in run.events():
        s = float(event["step"])
        ax.axvline(s, color=color, alpha=0.25, lw=0.8)
        y = event.get("loss")
        if not (isinstance(y, int | float) and math.isfinite(y)):
            if not steps:
                continue
            y = float(np.interp(s, steps, losses))
        ax.plot([s], [y], ls="", marker=EVENT_MARKERS.get(event["event"], "o"), color=color, ms=6, mfc="none")


def _event_legend(runs: list[RunRecords], handles: list, labels: list[str]) -> tuple[list, list[str]]:
    counts: dict[str, int] = {}
    for run in runs:
        for event in run.events():
            counts[event["event"]] = counts.get(event["event"], 0) + 1
    for name, n in sorted(counts.items()):
        handles.append(Line2D([], [], ls="", marker=EVENT_MARKERS.get(name, "o"), color="black", mfc="none"))
        labels.append(f"{name} ({n})")
    return handles, labels


def write_dashboard(runs: list[RunRecords], out: Path, per_panel: bool = True) -> list[Path]:
    """``out/dashboard.png`` (every selected panel in a grid) and, with ``per_panel``, ``out/<panel>.png``
    for each; returns the files written (none when no run has a single drawable key)."""
    panels = select_panels(runs)
    if not panels:
        return []
    out.mkdir(parents=True, exist_ok=True)
    cols = 2 if len(panels) <= 6 else 3
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(6.5 * cols, 3.8 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels, strict=False):
        draw_panel(ax, panel, runs)
    for ax in axes[len(panels) :]:
        fig.delaxes(ax)
    names = ", ".join(run.name for run in runs)
    fig.suptitle(names if len(names) < 120 else f"{len(runs)} runs", fontsize=11)
    written = [out / "dashboard.png"]
    _save(fig, written[0])
    if per_panel:
        for panel in panels:
            fig = Figure(figsize=(7, 4))
            draw_panel(fig.add_subplot(), panel, runs)
            written.append(out / f"{panel.name}.png")
            _save(fig, written[-1])
    return written


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the top row
    fig.savefig(path, format="png", dpi=100)
