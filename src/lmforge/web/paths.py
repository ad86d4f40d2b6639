"""What the server may read: files under RUNS_DIR only. A requested path is relative to RUNS_DIR; an
absolute path, a ``..`` part or a symbolic link that leads outside it is refused."""

from __future__ import annotations

from pathlib import Path, PurePosixPath


class PathRefused(ValueError):
    """A requested path that is not inside RUNS_DIR."""


def resolve_under(root: Path, rel: str) -> Path:
    """``root / rel`` resolved (symbolic links followed), refused unless it stays inside ``root``.

    Refused: an empty or absolute ``rel``, a ``..`` part, a backslash or NUL, and any path whose resolved
    form is not ``root`` or below it (a symbolic link out). Existence is not checked here."""
    if not rel or "\x00" in rel or "\\" in rel:
        raise PathRefused(f"{rel!r}: not a path under the runs folder")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("~") or any(part == ".." for part in pure.parts):
        raise PathRefused(f"{rel!r}: absolute paths and '..' are refused")
    base = root.resolve()
    target = (base / pure).resolve()
    if target != base and base not in target.parents:
        raise PathRefused(f"{rel!r}: leads outside the runs folder")
    return target
