"""Device choice, seeding and the random-number-generator state that a checkpoint carries."""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from lmforge.errors import UserError

log = logging.getLogger(__name__)


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
    """``train.deterministic``: make a compiled or eager CPU run a pure function of its config and data.

    The one source of run-to-run differences found on CPU in FP32 is the compiled backward pass of the
    token embedding: inductor lowers it to an accumulating ``index_put`` whose C++ loop adds each token's
    gradient row with atomic adds from several threads, so repeated tokens are summed in a varying order.
    With deterministic algorithms on, inductor (which reads the flag when it compiles) emits the serial
    ``aten::index_put_`` instead. Eager CPU runs were already bitwise reproducible. Filling
    uninitialised memory (the flag's other effect) is turned off: nothing reads it, and it costs time.
    Measured cost of the mode: within noise (step-time ratio 0.97-1.03). The flag is process-wide, so it
    is set to the run's value either way.
    """
    torch.use_deterministic_algorithms(enabled)
    if enabled:
        torch.utils.deterministic.fill_uninitialized_memory = False
        log.info(
            "train.deterministic: deterministic algorithms on, %d intra-op threads", torch.get_num_threads()
        )


def runtime_state() -> dict:
    """Process settings that a bitwise resume depends on (saved in checkpoints)."""
    return {"threads": torch.get_num_threads()}


def check_runtime_state(state: dict, deterministic: bool) -> None:
    """Warn when a deterministic run resumes with different process settings."""
    threads = state.get("threads")
    if deterministic and threads is not None and threads != torch.get_num_threads():
        log.warning(
            "train.deterministic: the checkpoint ran with %d threads, this process has %d; reductions may "
            "differ in the last bits (set OMP_NUM_THREADS=%d)",
            threads,
            torch.get_num_threads(),
            threads,
        )
