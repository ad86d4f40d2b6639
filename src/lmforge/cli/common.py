"""What every command module shares: this process's rank, printing once under ``torchrun``, the device."""

from __future__ import annotations

import os


def rank() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    return int(os.environ.get("RANK", "0") or 0)


def say(text: str) -> None:
    """Print the result of a command once: from rank 0 under torchrun."""
    if rank() == 0:
        print(text, flush=True)  # piped, a line shows when printed, not at exit (in step with the log)


def device(name: str):
    """The ``--device`` flag's device (``auto``: CUDA when present)."""
    from lmforge.train.runtime import pick_device

    return pick_device(name)
