"""Gradient checkpointing planner: activation memory and recompute of each policy (``none``, ``full``,
``every:K``, ``selective``) for one model, from ``lmforge estimate`` (``Estimate.activations`` /
``activation_parts``; ``plan.estimate.recompute_factor``; the step time), and beside them the figures
measured by ``benchmarks/activation_checkpointing.py --json FILE`` for any such file under RUNS_DIR, with
the formula (``plan.activations.activation_bytes``) for the benchmark's own shape. Seed defaults: 12
layers, checkpoint every 3."""

from __future__ import annotations

import json
from pathlib import Path

from flask import Blueprint, current_app, render_template

from lmforge.config import ModelConfig
from lmforge.plan import hardware, models
from lmforge.plan.activations import activation_bytes
from lmforge.plan.estimate import recompute_factor
from lmforge.web.accuracy import planner_accuracy
from lmforge.web.api import arg_choice, arg_int, json_api
from lmforge.web.paths import PathRefused, resolve_under
from lmforge.web.planner_inputs import PRECISIONS, PlannerInputs, choices
from lmforge.web.registry import Page

DEFAULTS = {
    "model": "gpt2-124m",
    "layers": 12,
    "k": 3,
    "micro_batch": 8,
    "seq_len": 1024,
    "precision": "bf16",
    "gpu": "h100-80gb",
}
BENCHMARK_GLOB = "activation_checkpointing*.json"
BENCHMARK_COMMAND = (
    "python benchmarks/activation_checkpointing.py --json RUNS_DIR/activation_checkpointing.json "
    "[--layers 12 --d-model 256 --batch 4 --seq 256]"
)

blueprint = Blueprint("checkpointing", __name__)


def policies(k: int) -> list[str]:
    """The compared policies: ``none``, ``full``, ``every:K``, ``selective``."""
    return ["none", "full", f"every:{k}", "selective"]


def checkpointing_inputs(
    model: str, layers: int, micro_batch: int, seq_len: int, train_precision: str, gpu: str
) -> PlannerInputs:
    """``lmforge estimate --model MODEL --gpu GPU --model.n_layers=L --train.micro_batch_size=B
    --data.seq_len=T --train.precision=P`` (the policy is added per row)."""
    return PlannerInputs(
        model,
        gpu,
        1,
        "lmforge",
        {
            "model.n_layers": layers,
            "train.micro_batch_size": micro_batch,
            "data.seq_len": seq_len,
            "train.precision": train_precision,
        },
    )


def policy_row(inputs: PlannerInputs, policy: str) -> dict:
    """The planner's figures for one policy: ``saved`` (what the forward keeps, ``activations`` minus
    the transient on top of it), ``recompute_peak`` (one checkpointed block recomputed during backward),
    ``forward_casts`` (autocast's cached weight copies at the end of forward), ``transient`` (the larger
    of the two), ``activations`` (``saved + transient``, ``Estimate.activations``), the device total, the
    compute factor (``Estimate.recompute`` = ``recompute_factor(policy)``: 1, 4/3, 1 + 1/(3K), 1.03),
    compute and step seconds, and the command that prints them."""
    one = inputs.but({"train.activation_checkpointing": policy})
    est = one.estimate()
    recompute_peak = est.activation_parts.get("recompute", 0.0)
    forward_casts = est.activation_parts.get("forward_casts", 0.0)
    transient = max(recompute_peak, forward_casts)
    return {
        "policy": policy,
        "command": one.command(),
        "saved": est.activations - transient,
        "recompute_peak": recompute_peak,
        "forward_casts": forward_casts,
        "transient": transient,
        "activations": est.activations,
        "activation_parts": est.activation_parts,
        "total": est.total,
        "fits": est.fits,
        "recompute": est.recompute,
        "recompute_formula": recompute_factor(policy),
        "compute_s": est.compute_s,
        "step_s": est.step_s,
    }


def compared(rows: list[dict]) -> list[dict]:
    """Each row with its ratios to ``none`` (the first row): memory and step time."""
    base = rows[0]
    return [
        {
            **r,
            "activations_ratio": r["activations"] / base["activations"],
            "step_ratio": r["step_s"] / base["step_s"],
        }
        for r in rows
    ]


def benchmark_files(root: Path) -> list[str]:
    """``activation_checkpointing*.json`` in ``root`` and up to two folders below, as paths relative to
    it; only those :func:`resolve_under` accepts (no symbolic link out of ``root``)."""
    found = []
    for pattern in (BENCHMARK_GLOB, f"*/{BENCHMARK_GLOB}", f"*/*/{BENCHMARK_GLOB}"):
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            try:
                if resolve_under(root, rel).is_file():
                    found.append(rel)
            except PathRefused:
                continue
    return found


def benchmark_formula(shape: dict, policy: str) -> dict:
    """The formula for the benchmark's own run: ``activation_bytes`` of its Llama model (``layers``,
    ``d_model``, ``heads``; no document mask: it passes no document ids), FP32 on CPU, flash attention,
    loss chunk 1024 of the fused head + loss it measures (``model/fused_loss.py``, through ``NextTokenLoss``);
    ``saved_bytes`` is ``ActivationBytes.total`` (what the benchmark measures) and the compute factor
    ``recompute_factor(policy)``."""
    cfg = ModelConfig(
        arch="llama",
        n_layers=shape["layers"],
        d_model=shape["d_model"],
        n_heads=shape["heads"],
        doc_mask=False,
    )
    a = activation_bytes(
        cfg,
        shape["vocab"],
        shape["seq"],
        shape["batch"],
        policy,
        4,
        "flash",
        1024,
        device_type="cpu",
        loss="fused",
    )
    return {"saved_bytes": a.total, "compute_ratio": recompute_factor(policy)}


def read_benchmark(root: Path, rel: str) -> dict:
    """One benchmark JSON (its ``shape``, ``rounds``, ``steps``, ``threads`` and per-policy ``rows``),
    each row with the formula beside it; a file that is not the benchmark's format gives ``error``."""
    path = resolve_under(root, rel)
    try:
        data = json.loads(path.read_text())
        shape = data["shape"]
        rows = []
        for r in data["rows"]:
            formula = benchmark_formula(shape, r["policy"])
            rows.append(
                {
                    **{k: r[k] for k in ("policy", "saved_bytes", "saved_ratio", "time_ratio", "cpu_ratio")},
                    "flops_ratio": r["flops_ratio"],
                    "formula_saved_bytes": formula["saved_bytes"],
                    "formula_compute_ratio": formula["compute_ratio"],
                }
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {"file": rel, "error": f"{rel}: not a benchmarks/activation_checkpointing.py JSON ({exc})"}
    return {
        "file": rel,
        "shape": shape,
        "rounds": data.get("rounds"),
        "steps": data.get("steps"),
        "threads": data.get("threads"),
        "rows": rows,
    }


def checkpointing_figures(inputs: PlannerInputs, k: int, root: Path) -> dict:
    """The planner's row of each policy (with ratios to ``none``), its measured accuracy
    (``web/accuracy.py``) and every benchmark file's measured figures beside the formula."""
    files = benchmark_files(root)
    return {
        "policies": compared([policy_row(inputs, p) for p in policies(k)]),
        "accuracy": planner_accuracy(),
        "measured": [read_benchmark(root, rel) for rel in files],
        "benchmark_command": BENCHMARK_COMMAND,
    }


@blueprint.get("/checkpointing")
def view():
    return render_template(
        "checkpointing.html",
        title="Gradient checkpointing",
        defaults=DEFAULTS,
        **choices(),
    )


@blueprint.get("/api/checkpointing")
@json_api
def api():
    layers = arg_int("layers", DEFAULTS["layers"], 1, 1024)
    k = arg_int("k", DEFAULTS["k"], 1, layers)
    inputs = checkpointing_inputs(
        arg_choice("model", DEFAULTS["model"], list(models.MODELS)),
        layers,
        arg_int("micro_batch", DEFAULTS["micro_batch"], 1, 4096),
        arg_int("seq_len", DEFAULTS["seq_len"], 8, 1 << 17),
        arg_choice("precision", DEFAULTS["precision"], PRECISIONS),
        arg_choice("gpu", DEFAULTS["gpu"], list(hardware.GPUS)),
    )
    return checkpointing_figures(inputs, k, current_app.config["RUNS_DIR"])


PAGE = Page(
    "checkpointing",
    "Gradient checkpointing",
    30,
    "activation memory and recompute of none, full, every-K and selective checkpointing (seed: 12 layers, "
    "every 3), with the benchmark's measured figures beside the formula",
    blueprint,
)
