"""Launching real multi-process runs from tests: ``torchrun`` on this machine, gloo on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun(
    nproc: int,
    args: list[str],
    timeout: float = 600,
    extra: list[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=NPROC [extra] ARGS`` (``ARGS``: a script and its arguments,
    or ``-m module ...``), one intra-op thread per process (``LMFORGE_TEST_THREADS`` in the environment:
    that many, to run the tests at another thread count), Python's fault handler on, ``env`` added to
    the environment; returns the finished process (output captured)."""
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints its Python stacks to stderr
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("LMFORGE_TEST_THREADS", "1"),
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra]
    return subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)


def worker(name: str) -> str:
    """Path of a worker script in ``tests/distributed/``."""
    return str(REPO / "tests" / "distributed" / name)
