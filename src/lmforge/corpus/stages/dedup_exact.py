"""``dedup_exact``: remove documents whose normalised text equals an earlier document's.

Signature: the 128-bit BLAKE2b digest of the normalised text (Unicode normal form, lower case, runs of
whitespace collapsed to one space, ends stripped), so copies that differ only in case, spacing or
Unicode presentation count as the same. ``plan`` walks the signatures in corpus order and records the
first holder of each digest in an SQLite table under ``workdir`` (on disk, so memory stays bounded
whatever the corpus size; SQLite ships with Python and gives concurrent read-only lookups to the
``apply`` workers). ``apply`` removes every document that is not the first holder of its digest, as
``dedup_exact.duplicate`` with ``duplicate_of`` = the first holder's id.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lmforge.corpus.document import Doc, Drop, key_text
from lmforge.corpus.stages.base import CorpusStage, StageParams
from lmforge.corpus.stages.docindex import scratch_db

_SPACE = re.compile(r"\s+")
DB = "first_holders.sqlite"


class ExactDedupParams(StageParams):
    """How text is normalised before hashing.

    Defaults: NFKC, lower case and collapsed whitespace, the normalisation commonly applied before exact
    hashing (CCNet, Wenzek et al., 2020, hashes lines after lower-casing and normalising them; NFKC
    folds compatibility forms such as full-width letters and ligatures onto their plain equivalents).
    """

    unicode_form: Literal["NFKC", "NFC", "none"] = Field("NFKC", description="Unicode normal form, or none")
    lowercase: bool = Field(True, description="compare case-insensitively (str.casefold)")
    collapse_whitespace: bool = Field(
        True, description="runs of whitespace count as one space; ends stripped"
    )


def normalise(text: str, p: ExactDedupParams) -> str:
    if p.unicode_form != "none":
        text = unicodedata.normalize(p.unicode_form, text)
    if p.lowercase:
        text = text.casefold()
    if p.collapse_whitespace:
        text = _SPACE.sub(" ", text).strip()
    return text


class ExactDedup(CorpusStage):
    name: ClassVar[str] = "dedup_exact"
    Params: ClassVar[type[StageParams]] = ExactDedupParams
    filters: ClassVar[bool] = True  # no threshold: the same at every strictness level above 0

    def __init__(self, params: StageParams | None = None):
        super().__init__(params)
        self._db: dict[Path, sqlite3.Connection] = {}

    def signature(self, doc: Doc) -> bytes:
        assert isinstance(self.params, ExactDedupParams)
        return hashlib.blake2b(normalise(doc.text, self.params).encode("utf-8"), digest_size=16).digest()

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        db, tmp = scratch_db(workdir / DB)
        db.execute("CREATE TABLE first (h BLOB PRIMARY KEY, k TEXT, id TEXT) WITHOUT ROWID")
        total = duplicates = 0
        for ref, sig in signatures:
            assert ref is not None
            total += 1
            cur = db.execute("INSERT OR IGNORE INTO first VALUES (?, ?, ?)", (sig, key_text(ref.key), ref.id))
            duplicates += cur.rowcount == 0
        db.commit()
        db.close()
        os.replace(tmp, workdir / DB)
        return {"documents": total, "unique": total - duplicates, "duplicates": duplicates}

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        db = self._db.get(workdir)
        if db is None:
            uri = f"file:{(workdir / DB).resolve()}?mode=ro&immutable=1"
            db = self._db[workdir] = sqlite3.connect(uri, uri=True, check_same_thread=False)
        row = db.execute("SELECT k, id FROM first WHERE h = ?", (self.signature(doc),)).fetchone()
        if row is None or row[0] == key_text(doc.key):
            return doc
        return self.drop("duplicate", duplicate_of=row[1])

    def __getstate__(self) -> dict[str, Any]:  # connections do not travel between processes
        return {**self.__dict__, "_db": {}}
