"""PNG charts (matplotlib, Agg canvas, no pyplot state): the learning-rate schedule of a recipe, the
learning-rate sweep of ``lr-find`` and the muP coordinate check. Each function draws one figure from
the values it is given and writes it to ``path`` as PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lmforge.config import Config
from lmforge.optim.schedules import lr_curve, warmup_steps


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)


def schedule_chart(lrs: list[float], path: Path, title: str) -> Figure:
    """Learning rate (y) at each optimizer step (x, 0-based). Returns the figure (its line holds ``lrs``)."""
    fig = Figure(figsize=(7, 3.5))
    ax = fig.add_subplot()
    ax.plot(range(len(lrs)), lrs, color="tab:blue")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _save(fig, path)
    return fig


def lr_find_chart(
    lrs: list[float], losses: list[float], smoothed: list[float], suggestion, path: Path
) -> Figure:
    """Loss against learning rate (log x): raw, smoothed, and the suggested rate as a marker."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(lrs, losses, color="tab:gray", alpha=0.4, label="loss")
    ax.plot(lrs, smoothed, color="tab:blue", label="smoothed loss")
    ax.axvline(suggestion.lr, color="tab:red", ls="--", label=f"suggestion {suggestion.lr:.2g}")
    ax.axvline(
        suggestion.min_over_10, color="tab:orange", ls=":", label=f"min / 10 {suggestion.min_over_10:.2g}"
    )
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss (nats)")
    low = min(min(losses), min(smoothed))
    top = max(smoothed[0], losses[0])  # the divergent tail is cut at the starting loss
    ax.set_ylim(low - 0.05 * (top - low), top + 0.15 * (top - low))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    _save(fig, path)
    return fig


def coord_check_chart(check: Any, path: Path) -> Figure:
    """One row per parametrisation, one panel per recorded step: mean |activation| against width
    (log-log), a line per layer. Flat lines mean width-independent activations."""
    params = list(check.sizes)
    n_t = check.steps + 1
    shown = sorted({round(i * (n_t - 1) / 3) for i in range(4)}) if n_t > 4 else list(range(n_t))
    fig = Figure(figsize=(3.2 * len(shown), 3.0 * len(params)))
    axes = fig.subplots(len(params), len(shown), squeeze=False, sharey="row")
    colors = {layer: f"C{i % 10}" for i, layer in enumerate(check.layers)}
    for r, param in enumerate(params):
        for c, t in enumerate(shown):
            ax = axes[r][c]
            for layer in check.layers:
                ys = [check.sizes[param][w][layer][t] for w in check.widths]
                ax.plot(check.widths, ys, marker="o", ms=3, color=colors[layer], label=layer)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{param}, step {t}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            if r == len(params) - 1:
                ax.set_xlabel("width (d_model)")
            if c == 0:
                ax.set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7, loc="best")
    _save(fig, path)
    return fig


def write_schedule(cfg: Config, out: Path) -> list[float]:
    """The learning rate of every step of ``cfg`` (:func:`lr_curve`) drawn to ``out`` (PNG) and written
    beside it as ``<out stem>.json`` (``{"step": [...], "lr": [...]}``); returns the rates."""
    lrs = lr_curve(cfg.schedule, cfg.optim.lr, cfg.train.steps)
    s = cfg.schedule
    title = f"{s.name}: peak {cfg.optim.lr:g}, warmup {warmup_steps(s.warmup, cfg.train.steps)}, {cfg.train.steps} steps"
    if s.name == "plateau":
        title += " (as if the validation loss kept improving)"
    out.parent.mkdir(parents=True, exist_ok=True)
    schedule_chart(lrs, out, title)
    out.with_suffix(".json").write_text(
        json.dumps({"schedule": s.model_dump(mode="json"), "step": list(range(len(lrs))), "lr": lrs}) + "\n"
    )
    return lrs


MEMORY_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "master weights": "tab:purple",
    "optimizer states": "tab:green",
    "activations": "tab:red",
    "temporaries": "tab:brown",
    "overhead": "tab:gray",
}


def memory_chart(
    bars: list[tuple[str, dict[str, float]]], memory_bytes: float, margin: float, path: Path, title: str
) -> Figure:
    """Stacked bars of per-device memory (GiB), one bar per ``(label, {row: bytes})``, with the device's
    memory and the ``margin`` limit as horizontal lines."""
    gib = 2**30
    fig = Figure(figsize=(max(5.0, 1.1 * len(bars) + 3), 4.5))
    ax = fig.add_subplot()
    xs = range(len(bars))
    bottom = [0.0] * len(bars)
    for row, color in MEMORY_COLORS.items():
        heights = [parts.get(row, 0.0) / gib for _, parts in bars]
        if any(heights):
            ax.bar(xs, heights, bottom=bottom, color=color, label=row, width=0.6)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.axhline(memory_bytes / gib, color="black", lw=1, label=f"device memory {memory_bytes / gib:.1f} GiB")
    ax.axhline(margin * memory_bytes / gib, color="black", ls="--", lw=1, label=f"{margin:.0%} margin")
    ax.set_xticks(list(xs), [label for label, _ in bars], fontsize=7)
    ax.set_ylabel("GiB per device")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)
    return fig


def tokenizer_compare_chart(result: dict[str, Any], path: Path) -> Figure:
    """``lmforge tokenizers compare``: one panel per metric (fertility, bytes per token and, when a model
    was trained, held-out bits per byte); bars per tokenizer kind, grouped by (domain, vocabulary size)."""
    rows = result["results"]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    sizes = list(dict.fromkeys(r["vocab_size"] for r in rows))
    domains = result["domains"]
    groups = [(d, v) for d in domains for v in sizes]
    panels = [("fertility", "tokens per word (fertility)"), ("bytes_per_token", "UTF-8 bytes per token")]
    model = all("model" in r for r in rows) and rows
    if model:
        panels.append(("bpb", f"held-out bits per byte after {rows[0]['model']['steps']} steps"))
    fig = Figure(figsize=(max(7.0, 1.1 * len(groups) + 2), 3.0 * len(panels)))
    width = 0.8 / len(kinds)
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        for k, kind in enumerate(kinds):
            values = []
            for d, v in groups:
                row = next(r for r in rows if r["kind"] == kind and r["vocab_size"] == v)
                source = row["model"]["domains"] if key == "bpb" else row["domains"]
                values.append(source.get(d, {}).get(key, float("nan")))
            xs = [g + (k - (len(kinds) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, values, width, label=kind)
        ax.set_xticks(range(len(groups)), [f"{d}\n{v}" for d, v in groups], fontsize=8)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.2)  # room for the legend above the bars
        if i == 0:
            ax.legend(fontsize=8, ncol=len(kinds), loc="upper right")
            ax.set_title("tokenizers on the held-out documents (domain / vocabulary size)", fontsize=10)
    _save(fig, path)
    return fig


def estimate_chart(result: Any, path: Path, gpus: int, margin: float, weights: str) -> Figure:
    """``lmforge estimate --plot``: one stacked bar of the asked layout, then one per layout the search
    found (``result``: ``plan/request.py::EstimateResult``)."""
    est, hw = result.estimate, result.hw
    bars = [(f"asked: {est.layout.describe()}", est.rows())] + [
        (e.layout.describe(), e.rows()) for e in result.found
    ]
    title = (
        f"{result.name} on {gpus} x {hw.name}, {result.precision}, {result.workload.optimizer} "
        f"({weights} accounting)"
    )
    labelled = [(label.replace(", ", "\n"), rows) for label, rows in bars]
    return memory_chart(labelled, hw.memory_bytes, margin, Path(path), title)


def experiment_chart(
    curves: dict[str, list[list[tuple[int, float]]]],
    finals: dict[str, list[float]],
    path: Path,
    title: str,
) -> Figure:
    """``lmforge experiment``'s figure. Left: each arm's validation loss against the step, the mean over
    its seeds (at the steps every seed evaluated) with a band of +- one sample standard deviation. Right:
    each arm's validation losses at equal tokens, one point per seed, and the mean with +- sd error bars."""
    fig = Figure(figsize=(11, 4))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    colors = [f"C{i % 10}" for i in range(len(curves))]
    for (label, runs), color in zip(curves.items(), colors, strict=True):
        common = sorted(set.intersection(*(set(s for s, _ in c) for c in runs))) if runs else []
        ys = np.array([[dict(c)[s] for s in common] for c in runs])
        if not common:
            continue
        mid = ys.mean(axis=0)
        sd = ys.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros_like(mid)
        left.plot(common, mid, color=color, label=f"{label} (n={len(runs)})")
        left.fill_between(common, mid - sd, mid + sd, color=color, alpha=0.2, linewidth=0)
    left.set_xlabel("step")
    left.set_ylabel("validation loss (mean +- sd over seeds)")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    for i, (values, color) in enumerate(zip(finals.values(), colors, strict=True)):
        right.scatter([i] * len(values), values, color=color, alpha=0.6, s=18)
        if values:
            sd = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
            right.errorbar([i + 0.15], [float(np.mean(values))], yerr=[sd], fmt="o", color=color, capsize=5)
    right.set_xticks(range(len(finals)))
    right.set_xticklabels(list(finals), rotation=15, fontsize=7, ha="right")
    right.set_ylabel("validation loss at equal tokens")
    right.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    _save(fig, path)
    return fig
