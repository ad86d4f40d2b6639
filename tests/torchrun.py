"""Launching real multi-process runs from tests: ``torchrun`` on this machine, gloo on CPU."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# LMFORGE_TEST_LAUNCHER=torchrun: every launch through a real torchrun (the warm launcher's check)
LAUNCHER = os.environ.get("LMFORGE_TEST_LAUNCHER", "warm")
_zygote = None


# Variables read when torch, lmforge, glibc or the interpreter load (the zygote read them once): a launch in
# which one differs from the zygote's start gets a new zygote. Every other variable reaches the ranks as is.
READ_AT_IMPORT = (
    "TORCH", "PYTORCH", "ATEN_", "DNNL_", "MKL_", "OMP_", "KMP_", "GOMP_", "MALLOC_", "LMFORGE_", "PYTHON",
    "LD_", "CUDA", "NCCL_", "GLOO_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
)  # fmt: skip


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


def _warm(env: dict[str, str]):
    """The warm launcher (tests/launcher.py) for this environment, started on first use; a new one when a
    variable read at import changed since (``READ_AT_IMPORT``)."""
    global _zygote
    from tests.launcher import Zygote

    if _zygote is None or _read_at_import(_zygote.env) != _read_at_import(env) or not _zygote.alive():
        if _zygote is not None:
            _zygote.close()
        _zygote = Zygote(env)
        atexit.register(_zygote.close)
    return _zygote


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
    the environment; returns the finished process (output captured).

    Without ``extra`` or ``env`` the ranks are forked from the warm launcher (``tests/launcher.py``: the
    same environment, module and argv as torchrun's workers, without an import of torch per rank); with
    either, or ``LMFORGE_TEST_LAUNCHER=torchrun``, a real torchrun starts them."""
    # PYTHONFAULTHANDLER: a rank killed by a signal (SIGABRT, SIGSEGV) prints its Python stacks to stderr
    full = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("LMFORGE_TEST_THREADS", "1"),
        "PYTHONPATH": str(REPO / "src"),
        "PYTHONFAULTHANDLER": "1",
    }
    if not extra and not env and LAUNCHER != "torchrun":
        with tempfile.TemporaryDirectory(prefix="launch-") as folder:
            return _warm(full).launch(nproc, args, timeout, Path(folder), full)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra]
    full.update(env or {})
    return subprocess.run([*cmd, *args], env=full, capture_output=True, text=True, timeout=timeout)


def worker(name: str) -> str:
    """Path of a worker script in ``tests/distributed/``."""
    return str(REPO / "tests" / "distributed" / name)
