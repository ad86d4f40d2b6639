"""The one document type of lmforge: what readers yield, stages pass on and training tokenizes.

:class:`Doc` travels through ``lmforge data`` (readers -> stages -> ``OUT/kept``) and is also what the
training side reads from its sources (:mod:`lmforge.data.sources`), so there is a single record type
from raw file to token shard. :class:`Drop` is why a document was removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Doc:
    """A document.

    ``id`` is the input's id (its id field, else ``path:line`` or the file path); ``key`` orders the
    corpus (source index, file index, line): deterministic, so "keep the first of a cluster" means the
    same document on every run and every executor; ``meta`` carries what stages add (language score,
    PII counts) and is written out with the kept document.
    """

    id: str
    text: str
    domain: str
    key: tuple[int, int, int] = (0, 0, 0)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Drop:
    """Why a document was removed: ``reason`` is ``"<stage>.<rule>"``; duplicates name the kept one."""

    reason: str
    duplicate_of: str | None = None
