"""The one document type of lmforge: what readers yield, stages pass on and training tokenizes.

:class:`Doc` travels through ``lmforge data`` (readers -> stages -> ``OUT/kept``) and is also what the
training side reads from its sources (:mod:`lmforge.data.sources`), so there is a single record type
from raw file to token shard. :class:`Drop` is why a document was removed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeAlias

Measure: TypeAlias = int | float | str | tuple[str, ...] | None
"""What a rule measured or matched, and the bound it compared against: a number, a matched item (a
word, a line, a language code) or a tuple of allowed items; ``None`` where the rule has none."""


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


def key_text(key: tuple[int, int, int]) -> str:
    """A document's corpus-order key as text (``"source:file:line"``), as stages store it in SQLite."""
    return ":".join(map(str, key))


@dataclass(frozen=True)
class Drop:
    """Why a document was removed: ``reason`` is ``"<stage>.<rule>"``; duplicates name the kept one.

    ``value`` is what the rule measured on the document (a ratio, a count, or the matched item such as
    a bad word or the line holding a ``{``) and ``threshold`` the bound it failed (for a list rule, the
    allowed items); both stay ``None`` for rules without a measure (an empty page, a parser failure).
    They are written into ``OUT/removed`` so a removal can be checked without re-running the stage.
    """

    reason: str
    duplicate_of: str | None = None
    value: Measure = None
    threshold: Measure = None
