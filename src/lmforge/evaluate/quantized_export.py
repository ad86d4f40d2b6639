"""``lmforge export RUN --quantize SCHEME``: write a run's checkpoint with integer linear layers (the
folder's contents and its loader: ``evaluate/quantized.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.evaluate.quantized import INFO, WEIGHTS, quantize_model
from lmforge.evaluate.run_loading import load_run, pick_checkpoint
from lmforge.model.qat import check_scheme
from lmforge.posttrain.template import TEMPLATE_FILE


def export_quantized(
    run_dir: str | Path, scheme: str, group_size: int | None = None, out: str | Path | None = None,
    step: int | None = None,
) -> Path:  # fmt: skip
    """Write ``run_dir``'s checkpoint ``step`` (None: the newest) quantized as ``scheme`` into ``out``
    (default ``RUN/quantized-SCHEME``); ``group_size`` None: the run's ``qat.group_size``. Every check is
    made before anything is written."""
    run_dir = Path(run_dir)
    check_scheme(scheme, "--quantize")
    cfg, tok, model, at = load_run(run_dir, torch.device("cpu"), step)
    if cfg.lora.rank:
        raise UserError(
            f"--quantize: {run_dir} is a LoRA run; export it merged (lmforge export), import that folder "
            "(lmforge import) and quantize the imported run"
        )
    group_size = cfg.qat.group_size if group_size is None else group_size
    model.float().eval()
    layers = quantize_model(model, scheme, group_size)
    out = Path(out) if out is not None else run_dir / f"quantized-{scheme}"
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / WEIGHTS)
    shutil.copyfile(pick_checkpoint(run_dir, at) / "config.toml", out / "config.toml")
    shutil.copyfile(tok.path, out / "tokenizer.json")
    if (run_dir / TEMPLATE_FILE).is_file():
        shutil.copyfile(run_dir / TEMPLATE_FILE, out / TEMPLATE_FILE)
    info = {"scheme": scheme, "group_size": group_size, "step": at, "run": str(run_dir), "layers": layers}
    (out / INFO).write_text(json.dumps(info, indent=1) + "\n")
    return out
