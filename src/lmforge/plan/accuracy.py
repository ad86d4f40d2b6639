"""The planner's measured accuracy: ``accuracy.json`` beside this module, the accuracy matrix written by
measuring real steps against PyTorch's memory trackers (``docs/memory-accuracy.md``)."""

from __future__ import annotations

import json
from pathlib import Path

PATH = Path(__file__).with_name("accuracy.json")


def load_accuracy() -> dict | None:
    """The accuracy matrix (``PATH``, beside this module) as a dict, or None when it is absent (the
    planner's accuracy has not been measured in this install)."""
    if not PATH.is_file():
        return None
    return json.loads(PATH.read_text())
