"""Exact-substring deduplication with a suffix array (Lee et al. 2022, "Deduplicating Training Data
Makes Language Models Better", ExactSubstr).

A byte span of at least ``min_length`` bytes that already occurred earlier in the corpus (in corpus
order) is removed from the later document; the first occurrence stays. Spans never cross documents.

``plan`` (one process):

1. concatenates every document's UTF-8 bytes, each followed by the separator byte ``0xFF`` (which
   never occurs in UTF-8), into ``corpus.u8`` on disk;
2. builds the suffix array with libdivsufsort (through the maintained ``pydivsufsort`` package: an
   O(n log n) C implementation, far faster than anything written in numpy here) writing straight into
   a ``np.memmap`` on disk, and the LCP array with pydivsufsort's Kasai;
3. caps each adjacent LCP at the end of the documents: ``lcp'(i) = min(lcp(i), rem(SA[i]),
   rem(SA[i+1]))`` with ``rem(p)`` the bytes from ``p`` to its document's end. Because the separator
   never matches text, a raw common prefix only runs past a document end when both suffixes end their
   documents at the same offset, so the cap is exact: no match crosses a document boundary;
4. suffixes whose first ``min_length`` bytes are equal form runs of adjacent suffix-array entries with
   ``lcp' >= min_length`` (equality of a length-L prefix is an equivalence, and suffix-array order keeps
   each class contiguous). In each run the smallest position is the first occurrence; every other
   position ``p`` starts a window ``[p, p + min_length)`` that occurred before. These start flags are
   written to ``starts.u8``;
5. ``apply`` removes from a document every byte covered by a flagged window (a byte-level union of
   windows): exactly the bytes that belong to some length-``min_length`` span seen earlier. Cuts that
   split a multi-byte character drop the partial character. A document left with fewer than
   ``min_chars`` non-space characters is dropped as ``dedup_substring.empty``.

Memory: the corpus (n bytes), the suffix array (4n bytes, 8n from 2^31 bytes on) and the start flags
(n bytes) are memory-mapped files under ``workdir``; divsufsort needs only O(1) extra memory besides
them. The LCP step is the bound: Kasai's algorithm keeps a rank array and the LCP array in memory,
about 8n bytes (16n from 2^31 bytes on), while the later passes run in chunks. So a corpus needs about
8 bytes of RAM per byte of text at its peak; larger corpora are deduplicated in shards, as Lee et al.
do.
"""

from __future__ import annotations

import ctypes
import logging
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages import docindex
from lmforge.corpus.stages.base import CorpusStage, Knob, StageParams
from lmforge.errors import DataError

log = logging.getLogger(__name__)

SEPARATOR = 0xFF  # never a byte of UTF-8 text
_CHUNK = 1 << 22  # suffix-array entries per pass step


class Params(StageParams):
    """Exact-substring settings.

    Lee et al. (2022, section 4.1) remove repeats of 50 or more GPT-2 tokens (a few sentences). The
    default ``min_length = 100`` bytes is the lmforge data pipeline's choice for a byte-level corpus
    (about 20 English words): it removes shared boilerplate paragraphs while leaving common phrases.
    """

    min_length: int = Field(100, ge=8, description="Shortest repeated span removed, in bytes.")
    min_chars: int = Field(
        1, ge=0, description="A document left with fewer non-space characters than this is dropped."
    )


def suffix_array(corpus: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fills ``out`` (int32 or int64, len(corpus)) with the suffix array of ``corpus`` (uint8) using
    libdivsufsort in place; ``out`` may be a ``np.memmap``."""
    from pydivsufsort.dll import libdivsufsort, libdivsufsort64

    n = corpus.size
    if n == 0:
        return out
    src = corpus.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    if out.dtype == np.int32:
        ret = libdivsufsort.divsufsort(
            src, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), ctypes.c_int32(n)
        )
    else:
        ret = libdivsufsort64.divsufsort64(
            src, out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), ctypes.c_int64(n)
        )
    if ret != 0:
        raise RuntimeError(f"divsufsort failed with status {ret}")
    return out


def doc_remaining(pos: np.ndarray, doc_starts: np.ndarray, doc_end_of: np.ndarray) -> np.ndarray:
    """Bytes from each position to the end of its document (0 on a separator)."""
    pos = pos.astype(np.int64)
    return doc_end_of[np.searchsorted(doc_starts, pos, side="right") - 1] - pos


def linked(sa: np.ndarray, lcp: np.ndarray, rem: np.ndarray, min_length: int) -> np.ndarray:
    """``link[i]``: suffixes ``sa[i]`` and ``sa[i+1]`` share their first ``min_length`` bytes within their
    documents, i.e. ``min(lcp[i], rem[i], rem[i+1]) >= min_length`` (``lcp[i]`` is their raw LCP)."""
    return np.minimum(lcp[: sa.size - 1], np.minimum(rem[:-1], rem[1:])) >= min_length


def later_copies(sa: np.ndarray, link: np.ndarray) -> np.ndarray:
    """Positions of the later copies: every member of a run of linked entries but the run's smallest.

    ``link`` has ``len(sa) - 1`` entries; the range must start and end at run boundaries.
    """
    if not link.any():
        return np.zeros(0, dtype=np.int64)
    pos = sa.astype(np.int64)
    in_run = np.zeros(sa.size, dtype=bool)
    in_run[:-1] |= link
    in_run[1:] |= link
    is_start = in_run & ~np.concatenate(([False], link))  # first entry of each run
    run_start = np.flatnonzero(is_start)
    run_of = np.cumsum(is_start) - 1  # for entries in a run: the run they belong to
    members = np.where(in_run, pos, np.iinfo(np.int64).max)  # entries between runs do not count
    first = np.minimum.reduceat(members, run_start)
    later = in_run & (pos != first[np.maximum(run_of, 0)])
    return np.sort(pos[later])


def flag_later_copies(
    sa: np.ndarray,
    lcp: np.ndarray,
    doc_starts: np.ndarray,
    doc_end_of: np.ndarray,
    min_length: int,
    starts: np.ndarray,
    chunk: int,
) -> None:
    """Sets ``starts[p] = 1`` for every later copy, walking the suffix array ``chunk`` entries at a time
    (each step extended to the end of a run crossing it, so no run is split)."""
    n = sa.size

    def links(a: int, b: int) -> np.ndarray:
        seg = np.asarray(sa[a:b])
        return linked(seg, np.asarray(lcp[a:b]), doc_remaining(seg, doc_starts, doc_end_of), min_length)

    look = max(2, min(chunk, 65536))
    i = 0
    while i < n:
        j = min(n, i + chunk)
        while j < n:
            ahead = links(j - 1, min(n, j + look))  # ahead[k]: entries j-1+k and j+k are linked
            stop = np.flatnonzero(~ahead)
            if stop.size:
                j += int(stop[0])
                break
            j = min(n, j + look - 1)
        starts[later_copies(np.asarray(sa[i:j]), links(i, j))] = 1
        i = j


class SubstringDedup(CorpusStage):
    """Removes spans of ``min_length``+ bytes seen earlier in the corpus (suffix array + LCP)."""

    name: ClassVar[str] = "dedup_substring"
    Params: ClassVar[type[StageParams]] = Params
    filters: ClassVar[bool] = True
    # lenient: only repeats of 10,000+ bytes go; strict: the default 100 bytes (about Lee et al. 2022's
    # 50 tokens)
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("min_length", 10_000, 100, integer=True),)

    DB = "dedup_substring.sqlite"
    STARTS = "dedup_substring.starts.u8"

    def signature(self, doc: Doc) -> bytes:
        return doc.text.encode("utf-8")

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        p: Params = self.params  # type: ignore[assignment]
        workdir = Path(workdir)
        starts_path = workdir / self.STARTS
        with docindex.begin_plan(workdir, self.DB, self.name) as (scratch, index):
            corpus_path = scratch / "corpus.u8"
            doc_starts = array("q")
            n_docs = 0
            with open(corpus_path, "wb") as f:
                offset = 0
                rows = []
                for ref, text in signatures:
                    doc_id = ref.id if ref is not None else f"#{n_docs}"
                    rows.append((n_docs, doc_id, offset, offset + len(text)))
                    doc_starts.append(offset)
                    f.write(text)
                    f.write(bytes((SEPARATOR,)))
                    offset += len(text) + 1
                    n_docs += 1
                    if len(rows) >= 8192:
                        index.add(rows)
                        rows.clear()
                index.add(rows)
            n = offset
            starts = np.memmap(starts_path.with_suffix(".tmp"), dtype=np.uint8, mode="w+", shape=(max(n, 1),))
            dup_bytes = 0
            if n:
                dup_bytes = self._mark(
                    corpus_path, scratch, n, np.frombuffer(doc_starts, dtype=np.int64), starts
                )
            starts.flush()
            del starts
            starts_path.with_suffix(".tmp").replace(starts_path)
        text_bytes = n - n_docs
        log.info("dedup_substring: %d of %d bytes are repeats", dup_bytes, text_bytes)
        return {
            "documents": n_docs,
            "bytes": text_bytes,
            "duplicate_bytes": dup_bytes,
            "duplicate_fraction": round(dup_bytes / text_bytes, 6) if text_bytes else 0.0,
            "min_length": p.min_length,
        }

    def _mark(
        self, corpus_path: Path, scratch: Path, n: int, doc_starts: np.ndarray, starts: np.ndarray
    ) -> int:
        """Builds SA + LCP, flags the starts of later copies; returns the number of repeated bytes."""
        import pydivsufsort

        p: Params = self.params  # type: ignore[assignment]
        L = p.min_length
        corpus = np.memmap(corpus_path, dtype=np.uint8, mode="c", shape=(n,))  # kasai wants a writable buffer
        dtype = np.int32 if n < 2**31 else np.int64
        sa = np.memmap(scratch / "sa.bin", dtype=dtype, mode="w+", shape=(n,))
        suffix_array(corpus, sa)
        lcp = pydivsufsort.kasai(corpus, sa)  # lcp[i] = LCP(sa[i], sa[i+1]); the bound on memory
        doc_end_of = np.append(doc_starts[1:] - 1, n - 1)  # each document's separator position
        flag_later_copies(sa, lcp, doc_starts, doc_end_of, L, starts, _CHUNK)
        del lcp
        # Count covered bytes chunk by chunk (windows never cross documents, so a carry of L-1 suffices).
        covered = 0
        for a in range(0, n, _CHUNK):
            b = min(n, a + _CHUNK)
            lo = max(0, a - L + 1)
            covered += int(coverage(np.asarray(starts[lo:b]), L)[a - lo :].sum())
        return covered

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        p: Params = self.params  # type: ignore[assignment]
        workdir = Path(workdir)
        row = docindex.lookup(workdir / self.DB, doc.id, "SELECT a, b FROM docs WHERE id = ?")
        if row is None:
            raise DataError(
                f"dedup_substring: document {doc.id!r} was not in the planned corpus; re-run plan"
            )
        a, b = row
        raw = doc.text.encode("utf-8")
        if len(raw) != b - a:
            raise DataError(f"dedup_substring: document {doc.id!r} changed since plan; re-run plan")
        starts = np.memmap(workdir / self.STARTS, dtype=np.uint8, mode="r")
        flags = np.asarray(starts[a:b])
        if not flags.any():
            return doc
        keep = ~coverage(flags, p.min_length)
        text = np.frombuffer(raw, dtype=np.uint8)[keep].tobytes().decode("utf-8", errors="ignore")
        left = len("".join(text.split()))
        if left < p.min_chars:
            return self.drop("empty", value=left, threshold=p.min_chars)
        return Doc(
            doc.id, text, doc.domain, doc.key, {**doc.meta, "dedup_substring_removed": int((~keep).sum())}
        )


def coverage(flags: np.ndarray, length: int) -> np.ndarray:
    """``covered[x]``: some flagged start ``p`` has ``p <= x < p + length`` (sliding window count)."""
    c = np.cumsum(flags, dtype=np.int64)
    out = c.copy()
    out[length:] -= c[:-length]
    return out > 0
