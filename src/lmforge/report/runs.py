"""One run folder read back: its ``metrics.jsonl`` split into the five record kinds, series of one key,
``summary.json`` and the state of the run (finished, stopped, running or incomplete).

A record of ``metrics.jsonl`` is an **event** (it has ``event``), a **detail** record (``detail: true``),
an **evaluation** record (``val_loss``), a **step** record (``tokens_per_s``; older runs: ``loss``) or a
**task** record (downstream task scores of ``[eval]``: ``task/<name>/<metric>`` keys).
Non-finite values are written as ``null``; a series leaves them out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

KINDS = ("step", "eval", "detail", "event", "task")


def record_kind(record: dict[str, Any]) -> str | None:
    """The kind of one metrics record (``KINDS``), or None for a record of none of them."""
    if "event" in record:
        return "event"
    if record.get("detail") is True:
        return "detail"
    if "val_loss" in record:
        return "eval"
    if "tokens_per_s" in record or "loss" in record:
        return "step"
    if any(key.startswith("task/") for key in record):
        return "task"
    return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut short (a run writing it) is left out."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            out.append(record)
    return out


def finite(value: Any) -> bool:
    """A number that can be drawn: int or float, not bool, not NaN/Inf (``null`` in the file is None)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RunRecords:
    """A run folder: its name (the folder's), records by kind, summary (None before the end) and status."""

    path: Path
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    checkpoint_step: int | None = None  # newest complete checkpoint

    @property
    def name(self) -> str:
        return self.path.resolve().name

    def series(self, kind: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` in the records of ``kind``, finite values only, in file order."""
        steps, values = [], []
        for r in self.records.get(kind, []):
            if finite(r.get(key)):
                steps.append(int(r["step"]))
                values.append(float(r[key]))
        return steps, values

    def keys(self, kind: str) -> set[str]:
        """Every key with at least one finite value in the records of ``kind``."""
        return {k for r in self.records.get(kind, []) for k, v in r.items() if k != "step" and finite(v)}

    def events(self) -> list[dict[str, Any]]:
        """The event records, checkpoints left out (they mark no change in training)."""
        return [r for r in self.records.get("event", []) if r["event"] != "checkpoint"]

    @property
    def last_step(self) -> int | None:
        steps = [int(r["step"]) for kind in ("step", "eval") for r in self.records.get(kind, [])]
        return max(steps) if steps else None

    @property
    def status(self) -> str:
        """``finished`` (``summary.json`` written), ``stopped`` (stopped resumably: its newest checkpoint
        is at or past its last record) or ``running-or-incomplete`` (still writing, or killed)."""
        if self.summary is not None and not self.summary.get("stopped"):
            return "finished"
        last = self.last_step
        if self.checkpoint_step is not None and (last is None or self.checkpoint_step >= last):
            return "stopped"
        return "running-or-incomplete"


def open_run(path: str | Path) -> RunRecords:
    """Read the run folder ``path``; UserError when it is not one (no ``config.toml``)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"RUN: {path} does not exist; give a run folder (runs/NAME)")
    if not (path / "config.toml").is_file():
        raise UserError(
            f"RUN: {path} is not an lmforge run folder (no config.toml); give a folder under runs/"
        )
    records: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for record in read_metrics(path / "metrics.jsonl"):
        kind = record_kind(record)
        if kind is not None:
            records[kind].append(record)
    summary = None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = None
    return RunRecords(path, records, summary, _checkpoint_step(path))


def _checkpoint_step(path: Path) -> int | None:
    from lmforge.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(path)
    return None if ckpt is None else int(ckpt.name.rsplit("_", 1)[1])
