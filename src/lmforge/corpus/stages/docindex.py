"""An on-disk table from document id to what a corpus stage decided, for its ``apply`` phase.

A corpus stage's ``plan`` numbers the documents it sees (0, 1, 2, ... in corpus order) and records
each one's id with a few integers (a cluster root, a byte range). ``apply`` then runs in other
processes and looks a document up by its id. The table is an SQLite file: it lives on disk (``plan``
holds no per-document strings in memory), is written once and then read concurrently by any number of
processes, and its unique index on ``id`` catches a corpus that reuses an id (a decision keyed by id
would otherwise be ambiguous).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

from lmforge.errors import DataError

_READERS: dict[tuple[int, str], sqlite3.Connection] = {}


def scratch_db(path: Path) -> tuple[sqlite3.Connection, Path]:
    """A new SQLite file at ``path`` + ``.tmp`` (an older one removed) without journal or syncs, and
    that temporary path: ``plan`` fills it, closes it and renames it to ``path`` once it is complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(tmp)
    db.execute("PRAGMA journal_mode=OFF")
    db.execute("PRAGMA synchronous=OFF")
    return db, tmp


class DocIndexWriter:
    """Writes ``docs(idx, id, a, b)`` and ``links(idx, other, value)`` rows; :meth:`close` indexes them and renames the file into place.

    ``a`` and ``b`` are two integers per document whose meaning belongs to the stage.
    """

    def __init__(self, path: Path, stage: str):
        self.path = Path(path)
        self.stage = stage
        self.conn, self.tmp = scratch_db(self.path)
        self.conn.execute(
            "CREATE TABLE docs (idx INTEGER PRIMARY KEY, id TEXT NOT NULL, a INTEGER, b INTEGER)"
        )
        self.conn.execute("CREATE TABLE links (idx INTEGER PRIMARY KEY, other INTEGER NOT NULL, value REAL)")

    def add(self, rows: Iterable[tuple[int, str, int, int]]) -> None:
        self.conn.executemany("INSERT INTO docs VALUES (?, ?, ?, ?)", rows)

    def add_links(self, rows: Iterable[tuple[int, int, float | None]]) -> None:
        """Records ``(idx, other, value)``: document ``idx`` points at document ``other`` (its cluster's
        kept one); ``value`` is a measure of the pair the stage reports (a similarity), or None."""
        self.conn.executemany("INSERT INTO links VALUES (?, ?, ?)", rows)

    def id_of(self, idx: int) -> str:
        return self.conn.execute("SELECT id FROM docs WHERE idx = ?", (idx,)).fetchone()[0]

    def close(self) -> None:
        try:
            self.conn.execute("CREATE UNIQUE INDEX docs_id ON docs (id)")
        except sqlite3.IntegrityError:
            dup = self.conn.execute("SELECT id FROM docs GROUP BY id HAVING COUNT(*) > 1 LIMIT 1").fetchone()[
                0
            ]
            self.abort()
            raise DataError(
                f"{self.stage}: document id {dup!r} occurs more than once; give every document a unique id "
                "(the source's id field) before this stage"
            ) from None
        self.conn.commit()
        self.conn.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Discards the unfinished table (idempotent)."""
        self.conn.close()
        self.tmp.unlink(missing_ok=True)


def lookup(path: Path, doc_id: str, sql: str) -> tuple | None:
    """Runs ``sql`` (one ``?`` for the id) on the table at ``path``; one connection per process and file."""
    key = (os.getpid(), str(path))
    conn = _READERS.get(key)
    if conn is None:
        if not Path(path).exists():
            raise DataError(f"{path}: no plan found; run the stage's plan phase before apply")
        conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
        _READERS[key] = conn
    return conn.execute(sql, (doc_id,)).fetchone()


def forget(path: Path) -> None:
    """Closes this process's reader of ``path`` (a new plan replaced it)."""
    conn = _READERS.pop((os.getpid(), str(path)), None)
    if conn is not None:
        conn.close()


@contextlib.contextmanager
def begin_plan(workdir: Path, db_name: str, stage: str) -> Iterator[tuple[Path, DocIndexWriter]]:
    """A fresh ``<stage>.scratch`` folder under ``workdir`` and a new document index ``db_name`` for a
    corpus stage's ``plan`` (a previous plan's scratch and open reader are discarded).

    On a normal exit the index is closed into place; on an exception it is discarded, so no partial
    index ever looks complete. The scratch folder is removed either way.
    """
    scratch = workdir / f"{stage}.scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    db_path = workdir / db_name
    forget(db_path)
    index = DocIndexWriter(db_path, stage)
    try:
        yield scratch, index
        index.close()
    except BaseException:
        index.abort()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
