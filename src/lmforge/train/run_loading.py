"""Open a finished or running run folder: its config, tokenizer and newest checkpoint's model."""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.data.tokenizer import Tokenizer
from lmforge.errors import UserError
from lmforge.model.transformer import Transformer
from lmforge.recipe import load_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint


def load_run(run_dir: str | Path, device: torch.device) -> tuple[Config, Tokenizer, Transformer, int]:
    """(config, tokenizer, model with the newest checkpoint's weights, step) of ``run_dir``."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise UserError(
            f"RUN: {run_dir} is not an lmforge run folder (no config.toml); give a folder under runs/"
        )
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise UserError(f"RUN: {run_dir} has no complete checkpoint yet; train longer or pick another run")
    cfg = load_config(ckpt / "config.toml")
    tok = Tokenizer(run_dir / "tokenizer.json")
    state = load_checkpoint(ckpt)
    model = Transformer(
        cfg.model, tok.vocab_size, cfg.data.seq_len, cfg.train.attention, cfg.train.loss_chunk
    )
    model.load_state_dict(state["model"])
    return cfg, tok, model.to(device), int(state["progress"]["step"])
