"""The run folders under RUNS_DIR as the dashboard reads them: which folders are runs, the new complete
lines of a ``metrics.jsonl`` from a byte offset (so a live page fetches only what was written since its
last poll), and whether a run that has not finished is running now.

Every path here comes from :func:`lmforge.web.paths.resolve_under`; nothing is written.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.web.paths import PathRefused, resolve_under

# A run that has neither finished nor stopped resumably counts as running while its metrics.jsonl (or,
# before the first record, its config.toml) changed within this many seconds; after that it is
# "incomplete" (killed, crashed, or silent for longer than that, e.g. preparing a large corpus).
LIVE_WINDOW_S = 120.0
MAX_CHUNK_BYTES = 8 << 20  # one answer carries at most this much of metrics.jsonl; the page asks again


def list_runs(root: Path) -> list[str]:
    """The run folders under ``root``, as paths relative to it, sorted: every folder at depth 1 or 2 that
    holds a ``config.toml`` (``root`` itself as ``"."`` when it is a run). A run's own subfolders
    (checkpoints) are not searched, and folders whose resolved path leaves ``root`` are left out."""
    root = root.resolve()
    if (root / "config.toml").is_file():
        return ["."]
    found = []
    for first in _subdirs(root):
        try:
            path = resolve_under(root, first)
        except PathRefused:
            continue
        if (path / "config.toml").is_file():
            found.append(first)
            continue
        for second in _subdirs(path):
            rel = f"{first}/{second}"
            try:
                if (resolve_under(root, rel) / "config.toml").is_file():
                    found.append(rel)
            except PathRefused:
                continue
    return sorted(found)


def _subdirs(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if not e.name.startswith(".") and e.is_dir())
    except OSError:
        return []


def run_folder(root: Path, rel: str) -> Path:
    """The run folder ``rel`` under ``root``: PathRefused when it leads outside, UserError naming the
    ``run`` parameter when it is not a run folder (no ``config.toml``)."""
    path = resolve_under(root, rel)
    if not (path / "config.toml").is_file():
        raise UserError(f"run: {rel!r} is not a run folder under the runs folder (no config.toml)")
    return path


@dataclass(frozen=True)
class Chunk:
    """New complete lines of ``metrics.jsonl``: their records, the offset to ask from next time, and the
    file's identity (its inode); ``reset`` when the file was replaced or cut (a resume rewrites it), so
    the records start again from offset 0."""

    records: list[dict[str, Any]]
    offset: int
    file: str
    reset: bool


def read_new_records(path: Path, offset: int, file: str = "") -> Chunk:
    """The records of the complete lines of ``path`` from byte ``offset`` on (at most
    ``MAX_CHUNK_BYTES``; a line being written, without its newline yet, is left for the next call).

    ``file`` is the identity an earlier call returned: when it differs from the file's now, or the file is
    shorter than ``offset``, reading starts again at 0 with ``reset``. A missing file gives no records."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return Chunk([], 0, "", reset=offset > 0)
    ident = str(st.st_ino)
    reset = offset > st.st_size or (bool(file) and file != ident)
    start = 0 if reset else offset
    with path.open("rb") as fh:
        fh.seek(start)
        data = fh.read(MAX_CHUNK_BYTES)
    end = data.rfind(b"\n") + 1  # complete lines only
    records = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return Chunk(records, start + end, ident, reset)


def last_write(run: Path) -> float:
    """When the run last wrote: the modification time of ``metrics.jsonl`` (``config.toml`` before it
    exists), in seconds since the epoch."""
    metrics = run / "metrics.jsonl"
    return (metrics if metrics.is_file() else run / "config.toml").stat().st_mtime


def shown_status(status: str, written_at: float, now: float, window_s: float = LIVE_WINDOW_S) -> str:
    """The status the page shows: lmforge.report.runs' ``finished`` and ``stopped`` as they are; its
    ``running-or-incomplete`` as ``running`` when the run wrote within ``window_s`` seconds before
    ``now`` (``now - written_at <= window_s``), else ``incomplete``."""
    if status != "running-or-incomplete":
        return status
    return "running" if now - written_at <= window_s else "incomplete"


class RowCache:
    """Rows of the runs table, recomputed only when a run's files changed (its ``metrics.jsonl``'s size
    and time, ``summary.json``, its checkpoints folder): a poll of an idle runs folder costs a few stats.
    """

    def __init__(self) -> None:
        self._rows: dict[Path, tuple[tuple, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def stamp(run: Path) -> tuple:
        out = []
        for name in ("metrics.jsonl", "summary.json", "checkpoints", "config.toml"):
            try:
                st = (run / name).stat()
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def get(self, run: Path, make) -> dict[str, Any]:
        """The cached row of ``run``, or ``make(run)``'s when its files changed."""
        stamp = self.stamp(run)
        with self._lock:
            hit = self._rows.get(run)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        row = make(run)
        with self._lock:
            self._rows[run] = (stamp, row)
        return row
