"""The muP coordinate check: does activation size stay put as the model gets wider?

For each width and for both parametrisations (``standard`` and ``mup``), a model of the recipe's shape
with ``d_model`` set to that width (``d_ff`` scaled in proportion when the recipe fixes it; heads, depth
and everything else as in the recipe) trains ``steps`` optimizer steps at the recipe's peak learning rate
(constant, no warmup) on the same batches. Before the first step and after each step, one fixed batch is
run forward and the mean absolute value of each coordinate is recorded per layer: the embedding output,
each block's output (the residual stream) and the logits.

Under muP these sizes should not depend on the width (Yang et al. 2022, Tensor Programs V, Figure 5);
under the standard parametrisation with Adam they grow with it, because every update of a hidden matrix
moves its output by about ``lr * fan_in``. :func:`spread` is the summary: for each layer, the largest
size over the widths divided by the smallest, at the last step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError

from lmforge.config import Config, ModelConfig
from lmforge.data.loader import Batch
from lmforge.data.mixture import build_train_loader
from lmforge.data.prepare import PreparedData, prepare_data
from lmforge.errors import ConfigError
from lmforge.model.transformer import Transformer
from lmforge.precision import PrecisionPolicy
from lmforge.report.charts import coord_check_chart
from lmforge.train.build import build_run, validate
from lmforge.train.step import train_step

log = logging.getLogger(__name__)

PARAMETRISATIONS = ("standard", "mup")


@dataclass
class CoordCheck:
    """``sizes[param][width][layer][t]``: mean |x| of ``layer`` after ``t`` optimizer steps."""

    widths: list[int]
    steps: int
    layers: list[str]
    lr: float
    base_width: int
    sizes: dict[str, dict[int, dict[str, list[float]]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "widths": self.widths,
            "steps": self.steps,
            "layers": self.layers,
            "lr": self.lr,
            "mup_base_width": self.base_width,
            "sizes": {p: {str(w): v for w, v in by_w.items()} for p, by_w in self.sizes.items()},
            "spread": {p: spread(self, p) for p in self.sizes},
        }


def spread(check: CoordCheck, param: str, t: int = -1) -> dict[str, float]:
    """Per layer: ``max_w size / min_w size`` over the widths at step ``t`` (1 = width-independent)."""
    out = {}
    for layer in check.layers:
        vals = [check.sizes[param][w][layer][t] for w in check.widths]
        out[layer] = max(vals) / min(vals)
    return out


def width_config(model: ModelConfig, width: int, mup: bool) -> ModelConfig:
    """The recipe's model at ``d_model = width`` (``d_ff`` scaled with it when set), muP on or off."""
    update = {**model.model_dump(), "d_model": width, "mup": mup}
    if model.d_ff:
        update["d_ff"] = max(1, round(model.d_ff * width / model.d_model))
    try:
        return ModelConfig.model_validate(update)
    except ValidationError as exc:
        msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--widths: width {width} does not fit the recipe ({msg})") from None


def width_configs(model: ModelConfig, widths: list[int]) -> dict[tuple[str, int], ModelConfig]:
    """``(parametrisation, width) -> ModelConfig`` for every pair; ConfigError for unusable widths."""
    if len(widths) < 2 or sorted(set(widths)) != sorted(widths):
        raise ConfigError("--widths: give at least two different widths, e.g. --widths 64,128,256,512")
    return {(p, w): width_config(model, w, p == "mup") for p in PARAMETRISATIONS for w in widths}


@torch.no_grad()
def activation_sizes(model: Transformer, batch: Batch, precision: PrecisionPolicy) -> dict:
    """Mean |x| of the embedding output, each block's output and the logits on ``batch``."""
    sizes: dict[str, float] = {}

    def hook(name: str):
        def record(_module, _inputs, out):
            sizes[name] = float(out.float().abs().mean())

        return record

    handles = [model.embed.register_forward_hook(hook("embedding"))]
    handles += [b.register_forward_hook(hook(f"block{i}")) for i, b in enumerate(model.blocks.values())]
    was_training = model.training
    model.eval()
    try:
        batch = batch.to(precision.device)
        with precision.autocast():
            logits = model.logits(model(batch.inputs, batch.doc_ids))
        sizes["logits"] = float(logits.float().abs().mean())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return sizes


def coord_check(
    cfg: Config,
    widths: list[int],
    steps: int,
    batches: Callable[[], list[Batch]],
    data: PreparedData,
    precision: PrecisionPolicy,
) -> CoordCheck:
    """Run the check (see the module docstring). ``batches()`` gives ``steps`` micro-batches, the first
    of which is also the measurement batch; it is called once per model so every model sees the same.

    Each model is built by the training build path (``train/build.py::build_run``: meta device, init from
    ``train.seed``, the recipe's training module, optimizer and clipping), eager: compiling each of the
    models would cost more than its few steps."""
    models = width_configs(cfg.model, widths)
    layers = ["embedding", *(f"block{i}" for i in range(cfg.model.n_layers)), "logits"]
    check = CoordCheck(sorted(widths), steps, layers, cfg.optim.lr, cfg.model.mup_base_width)
    lr = cfg.optim.lr
    for param in PARAMETRISATIONS:
        check.sizes[param] = {}
        for width in check.widths:
            eager = cfg.train.model_copy(update={"compile": False})
            wcfg = cfg.model_copy(update={"model": models[(param, width)], "train": eager})
            run = build_run(wcfg, data)
            seen = batches()
            per_layer: dict[str, list[float]] = {name: [] for name in layers}
            for t in range(steps + 1):
                for name, value in activation_sizes(run.model, seen[0], precision).items():
                    per_layer[name].append(value)
                if t < steps:
                    train_step(run.module, run.optimizer, [seen[t]], lr, run.clipper, precision)
            check.sizes[param][width] = per_layer
            log.info(
                "mup-check: %s width %d: %s",
                param,
                width,
                ", ".join(f"{k} {v[-1]:.3g}" for k, v in per_layer.items()),
            )
    return check


def run_mup_check(cfg: Config, widths: list[int], steps: int, out_dir: Path) -> CoordCheck:
    """The check on the recipe's training data (first ``steps`` micro-batches of its training loader), written
    to ``out_dir/mup_check.json`` (sizes and spreads) and ``out_dir/mup_check.png``."""
    if steps < 1:
        raise ConfigError("--steps: give at least 1 training step")
    width_configs(cfg.model, widths)  # fail on a bad width before preparing data
    device = validate(cfg)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    data = prepare_data(cfg.data)

    def batches() -> list[Batch]:
        loader = build_train_loader(cfg, data, 1)
        return [loader.next_batch() for _ in range(steps)]

    check = coord_check(cfg, widths, steps, batches, data, precision)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mup_check.json").write_text(json.dumps(check.to_json(), indent=1) + "\n")
    coord_check_chart(check, out_dir / "mup_check.png")
    return check
