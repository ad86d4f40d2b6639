"""Atomic checkpoints of everything a run needs to continue exactly.

A checkpoint is a folder ``checkpoints/step_00000120/`` holding ``state.pt`` (model, optimizer,
scheduler step, loader position, RNG states, counters) and ``config.toml`` (the resolved config).
It is written under ``step_00000120.tmp/``, flushed to disk, and renamed into place: a crash mid-write
leaves only a ``.tmp`` folder, which is never taken for a checkpoint and is removed on the next start.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial(run_dir: Path) -> None:
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        for p in root.glob("*.tmp"):
            log.warning("checkpoint: removing incomplete %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], config_toml: str, keep: int) -> Path:
    """Write ``state`` for ``step`` atomically, then prune to the ``keep`` newest checkpoints."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    (tmp / "config.toml").write_text(config_toml)
    for f in tmp.iterdir():
        _fsync(f)
    if final.exists():  # re-saving the same step (e.g. the final one): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint: saved %s", final)
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only=False: the state holds numpy / Python RNG states written by lmforge itself.
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
