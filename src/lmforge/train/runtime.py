"""Device choice, seeding and the random-number-generator state that a checkpoint carries."""

from __future__ import annotations

import random

import numpy as np
import torch

from lmforge.errors import UserError


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; ``cuda`` without a GPU is a user error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda requested but no CUDA GPU is visible; use --train.device=cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def configure_determinism(enabled: bool) -> None:
    """``train.deterministic``: make a run a pure function of its config and data on this machine.

    Turns on PyTorch's deterministic algorithms (ops without a deterministic implementation raise) and
    inductor's deterministic mode; see the README's "Reproducibility" section for what is bitwise.
    """
    if not enabled:
        return
    torch.use_deterministic_algorithms(True)
