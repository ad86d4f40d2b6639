"""Fuzzy deduplication: MinHash signatures over word n-grams, LSH banding, verification, union-find.

Per document (``signature``, parallel):

1. words: the lower-cased text's UTF-8 bytes split into runs of ASCII letters/digits and non-ASCII
   bytes (so accented and non-Latin words stay whole; punctuation and spaces separate words);
2. shingles: every run of ``ngram`` consecutive words (a document with fewer words is one shingle),
   hashed to 64 bits;
3. MinHash: ``bands * rows`` hash functions ``h_k(x) = (a_k x + b_k mod 2^64) >> 32`` (multiply-add-
   shift, a universal family; ``a_k`` odd) applied to all shingle hashes at once as one numpy
   ``(shingles x functions)`` product; the signature is each function's minimum (uint32).

All hashing is vectorised numpy over the document's bytes: a word's hash is a position-weighted sum of
its bytes computed from one prefix sum (no Python loop over words or shingles), mixed with the 64-bit
MurmurHash3 finaliser. This is what makes signatures several times faster than hashing each shingle
string in Python (see ``benchmarks/minhash.py``).

Over the corpus (``plan``, one process, bounded memory):

4. LSH: the signature is cut into ``bands`` bands of ``rows`` values; each band hashes to a 64-bit
   bucket key. Records ``(bucket key, document number)`` are appended to one file per band; each band
   file is then sorted by key (in memory when it fits ``sort_memory_mb``, else split first into
   key-range partitions that do) and documents sharing a bucket become candidate pairs: each member
   with its predecessor in the bucket and with the bucket's first member (linear in the bucket size).
   The probability that a pair of Jaccard similarity ``s`` becomes a candidate is
   :func:`detection_probability` ``P(s) = 1 - (1 - s^r)^b``.
5. verification: a candidate pair is merged only if its similarity reaches ``threshold``: estimated
   from the full signatures (the fraction of equal MinHash values) or, with ``verify = "exact"``,
   the exact Jaccard similarity of the two shingle sets (then the signature also carries them).
6. clusters: union-find over document numbers; each cluster keeps its first document in corpus order
   (smallest ``Doc.key``, ties by arrival) and the others are dropped as
   ``dedup_minhash.duplicate`` with ``duplicate_of`` = the kept document's id, ``value`` = the
   similarity of the two (measured as verification measures it: the signatures' estimate, or the exact
   Jaccard with ``verify = "exact"``) and ``threshold``. A document that joined the cluster through
   other members can be less similar to the kept one than ``threshold``; the value shows it.

What ``plan`` holds in memory: the union-find parent array (8 bytes per document), one batch of
signatures while writing, one band partition while sorting (at most ``sort_memory_mb``) and one chunk
of candidate pairs while verifying. Signatures, bucket records, ids and decisions are on disk under
``workdir`` (ids and decisions in an SQLite table that ``apply`` reads).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages import docindex
from lmforge.corpus.stages.base import CorpusStage, Knob, StageParams
from lmforge.errors import DataError

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    # FineWeb (Penedo et al. 2024, datatrove's MinhashConfig defaults): 5-gram shingles, 112 hashes as
    # 14 bands of 8. The S-curve's midpoint is (1/14)^(1/8) ~ 0.72; verification at 0.7 only removes
    # candidates the banding let through well below that.
    "fineweb": {"ngram": 5, "bands": 14, "rows": 8, "threshold": 0.7, "verify": "signature"},
    # Near-duplicates (small edits of the same text): 3-word shingles (an edited word breaks at most
    # three), 20 bands of 5 (P(0.7) = 0.975, P(0.75) = 0.996) and exact verification at 0.7: replacing
    # 5% of the words keeps about 0.95^3 = 86% of the shingles, a Jaccard similarity near 0.75 (spread
    # down to ~0.65 on documents under ~100 words); unrelated prose scores below 0.1.
    "near_duplicates": {"ngram": 3, "bands": 20, "rows": 5, "threshold": 0.7, "verify": "exact"},
}

CURVE_POINTS = tuple(round(0.5 + 0.05 * i, 2) for i in range(10))  # 0.5, 0.55, ..., 0.95


def detection_probability(s: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """Probability that LSH makes a pair of Jaccard similarity ``s`` a candidate.

    ``P(s) = 1 - (1 - s^r)^b``: one band of ``r`` MinHash values matches with probability ``s^r``; the
    pair is a candidate when any of the ``b`` independent bands matches.
    """
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def detection_curve(bands: int, rows: int, points: Iterable[float] = CURVE_POINTS) -> dict[str, float]:
    """``{"0.50": P(0.5), ...}``: the banding's detection probabilities, rounded to 4 places."""
    return {f"{s:.2f}": round(float(detection_probability(s, bands, rows)), 4) for s in points}


TABLE_BEGIN = (
    "<!-- detection-table: generated by lmforge.corpus.stages.dedup_minhash.update_detection_table -->"
)
TABLE_END = "<!-- end detection-table -->"


def detection_table_markdown(
    presets: dict[str, dict[str, Any]] = PRESETS, points: Iterable[float] = CURVE_POINTS
) -> str:
    """A markdown table of :func:`detection_probability` ``P(s) = 1 - (1 - s^r)^b`` per preset (columns)
    at each similarity ``s`` of ``points`` (rows), with each banding's :func:`lsh_threshold`."""
    names = list(presets)
    head = " | ".join(f"{n} ({presets[n]['bands']}x{presets[n]['rows']})" for n in names)
    lines = [f"| Jaccard s | {head} |", "|---" * (len(names) + 1) + "|"]
    for s in points:
        cells = " | ".join(
            f"{float(detection_probability(s, presets[n]['bands'], presets[n]['rows'])):.4f}" for n in names
        )
        lines.append(f"| {s:.2f} | {cells} |")
    mids = " | ".join(f"{lsh_threshold(presets[n]['bands'], presets[n]['rows']):.3f}" for n in names)
    lines.append(f"| threshold (1/b)^(1/r) | {mids} |")
    return "\n".join(lines)


def update_detection_table(text: str) -> str:
    """``text`` (a markdown page) with the block between :data:`TABLE_BEGIN` and :data:`TABLE_END`
    replaced by :func:`detection_table_markdown`. Regenerate ``docs/dedup.md`` with::

        python -c "from pathlib import Path; from lmforge.corpus.stages.dedup_minhash import \\
            update_detection_table as u; p = Path('docs/dedup.md'); p.write_text(u(p.read_text()))"
    """
    a, b = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    return f"{text[:a]}\n{detection_table_markdown()}\n{text[b:]}"


def lsh_threshold(bands: int, rows: int) -> float:
    """The similarity where the S-curve is steepest, approximately ``(1/b)^(1/r)``."""
    return (1.0 / bands) ** (1.0 / rows)


class Params(StageParams):
    """MinHash-LSH settings. ``preset`` fills every field not given explicitly.

    Defaults are the ``fineweb`` preset: 5-word shingles and 14 bands of 8 hashes, as in FineWeb
    (Penedo et al. 2024, "The FineWeb Datasets", section 3.4) and datatrove's ``MinhashConfig``;
    verification at 0.7, just below that banding's threshold (1/14)^(1/8) ~ 0.72.
    """

    preset: Literal["fineweb", "near_duplicates"] = Field(
        "fineweb",
        description="Named settings: fineweb (5-grams, 14x8) or near_duplicates (3-grams, 20x5, exact).",
    )
    ngram: int = Field(5, ge=1, description="Words per shingle.")
    bands: int = Field(14, ge=1, description="LSH bands.")
    rows: int = Field(8, ge=1, description="MinHash values per band.")
    threshold: float = Field(
        0.7, ge=0.0, le=1.0, description="Jaccard similarity a candidate pair needs to merge."
    )
    verify: Literal["signature", "exact"] = Field(
        "signature",
        description="How candidates are verified: the signature's estimate, or the exact Jaccard of the shingle sets.",
    )
    seed: int = Field(1, description="Seed of the hash functions (the same on every worker).")
    sort_memory_mb: int = Field(
        512, ge=1, description="Memory for sorting one band's bucket records in plan."
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            preset = data.get("preset", "fineweb")
            if preset in PRESETS:
                data = {**PRESETS[preset], **data}
        return data


# --- hashing ----------------------------------------------------------------------------------------

_WORD_BYTE = np.zeros(256, dtype=bool)
_WORD_BYTE[ord("a") : ord("z") + 1] = True
_WORD_BYTE[ord("0") : ord("9") + 1] = True
_WORD_BYTE[0x80:] = True  # every byte of a non-ASCII character: such words stay whole
_SPAN = 1 << 20  # bytes hashed at once (the power tables grow to this size at most)


_S33 = np.uint64(33)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser (a bijection that spreads every input bit); in place, returns x."""
    t = x >> _S33
    x ^= t
    x *= _M1
    np.right_shift(x, _S33, out=t)
    x ^= t
    x *= _M2
    np.right_shift(x, _S33, out=t)
    x ^= t
    return x


@dataclass(frozen=True)
class MinHasher:
    """The hash functions of one ``(ngram, bands, rows, seed)`` setting; built once per process."""

    ngram: int
    bands: int
    rows: int
    seed: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, 0x6D696E68])
        k = self.bands * self.rows
        u64 = np.iinfo(np.uint64).max
        odd = lambda n: rng.integers(0, u64, size=n, dtype=np.uint64, endpoint=True) | np.uint64(1)  # noqa: E731
        object.__setattr__(self, "_q", odd(1)[0])  # base of the polynomial word hash
        object.__setattr__(self, "_pow", [np.ones(0, np.uint64), np.ones(0, np.uint64)])
        object.__setattr__(self, "_gram", odd(self.ngram))  # per word position within a shingle
        object.__setattr__(self, "_a", odd(k))
        object.__setattr__(self, "_b", rng.integers(0, u64, size=k, dtype=np.uint64, endpoint=True))
        object.__setattr__(self, "_band", odd(self.rows))

    @property
    def num_hashes(self) -> int:
        return self.bands * self.rows

    def _powers(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``q^i`` and ``q^-i`` (mod 2^64) for ``i < n``, grown on demand (``q`` is odd, so invertible)."""
        fwd, inv = self._pow
        if fwd.size < n:
            size = max(n, 2 * fwd.size, 4096)
            fwd = np.full(size, self._q, dtype=np.uint64)
            inv = np.full(size, pow(int(self._q), -1, 2**64), dtype=np.uint64)
            fwd[0] = inv[0] = 1
            np.multiply.accumulate(fwd, out=fwd)  # wraps mod 2^64
            np.multiply.accumulate(inv, out=inv)
            self._pow[:] = [fwd, inv]
        return fwd, inv

    def word_hashes(self, text: str) -> np.ndarray:
        """64-bit hashes of the text's words in order (see the module docstring for what a word is).

        A word of bytes ``x_s .. x_{e-1}`` hashes to ``fmix64(sum_i x_i q^(i-s) + (e - s))`` mod 2^64:
        one prefix sum ``C_k = sum_{i<k} x_i q^i`` over the text gives every word as ``(C_e - C_s) q^-s``.
        Texts longer than 1 MiB are cut between words and hashed piece by piece (bounded tables).
        """
        raw = np.frombuffer(text.lower().encode("utf-8"), dtype=np.uint8)
        if raw.size <= _SPAN:
            return self._word_hashes(raw)
        out, lo = [], 0
        while lo < raw.size:
            hi = min(raw.size, lo + _SPAN)
            if hi < raw.size:
                gaps = np.flatnonzero(~_WORD_BYTE[raw[lo:hi]])
                if gaps.size:  # cut after the last non-word byte (a longer word is split)
                    hi = lo + int(gaps[-1]) + 1
            out.append(self._word_hashes(raw[lo:hi]))
            lo = hi
        return np.concatenate(out)

    def _word_hashes(self, raw: np.ndarray) -> np.ndarray:
        n = raw.size
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        inword = np.zeros(n + 2, dtype=bool)  # padded with a non-word byte on each side
        np.take(_WORD_BYTE, raw, out=inword[1:-1])
        edges = np.flatnonzero(inword[1:] != inword[:-1])
        starts, ends = edges[0::2], edges[1::2]  # runs of word bytes alternate start, end
        fwd, inv = self._powers(n)
        prefix = np.empty(n + 1, dtype=np.uint64)
        prefix[0] = 0
        np.multiply(raw, fwd[:n], out=prefix[1:])
        np.cumsum(prefix, out=prefix)
        h = prefix[ends] - prefix[starts]
        h *= inv[starts]
        h += (ends - starts).astype(np.uint64)
        return fmix64(h)

    def shingle_hashes(self, text: str) -> np.ndarray:
        """64-bit hashes of every run of ``ngram`` consecutive words (all words if fewer)."""
        w = self.word_hashes(text)
        n = min(self.ngram, w.size)
        if n == 0:
            return w
        m = w.size - n + 1
        h = w[:m] * self._gram[0]
        for j in range(1, n):
            h += w[j : j + m] * self._gram[j]
        h += np.uint64(n)
        return h

    def minhash(self, shingles: np.ndarray, chunk: int = 1024) -> np.ndarray:
        """``min over shingles of (a_k x + b_k) >> 32`` for each of the ``bands * rows`` functions (uint32)."""
        best = np.full(self.num_hashes, np.iinfo(np.uint64).max, dtype=np.uint64)
        for i in range(0, shingles.size, chunk):
            x = shingles[i : i + chunk, None] * self._a
            x += self._b
            np.minimum(best, x.min(axis=0), out=best)
        return (best >> np.uint64(32)).astype(np.uint32)

    def band_keys(self, sigs: np.ndarray) -> np.ndarray:
        """64-bit bucket key of every band of each signature: ``(n, bands*rows) -> (n, bands)``."""
        s = sigs.reshape(sigs.shape[0], self.bands, self.rows).astype(np.uint64)
        keys = (s * self._band).sum(axis=2, dtype=np.uint64)
        keys += np.arange(self.bands, dtype=np.uint64)
        return fmix64(keys)


_HASHERS: dict[tuple[int, int, int, int], MinHasher] = {}


def hasher_for(p: Params) -> MinHasher:
    key = (p.ngram, p.bands, p.rows, p.seed)
    if key not in _HASHERS:
        _HASHERS[key] = MinHasher(*key)
    return _HASHERS[key]


@dataclass(frozen=True)
class MinHashSignature:
    """One document's signature: its MinHash values and, for exact verification, its shingle set."""

    minhash: np.ndarray
    shingles: np.ndarray | None = None


# --- plan helpers -------------------------------------------------------------------------------------

_RECORD = np.dtype([("key", "<u8"), ("idx", "<u4")])  # 12 bytes per (bucket key, document number)
_MAX_DOCS = np.iinfo(np.uint32).max


def bucket_pairs(keys: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs ``(i, j)``, ``i < j``, among documents that share a bucket key.

    ``idx`` must be ascending within each key (records are written in document order and sorted
    stably). Each bucket member is paired with its predecessor and with the bucket's first member:
    linear in the bucket size, and enough to connect a bucket of true duplicates.
    """
    order = np.argsort(keys, kind="stable")
    k, d = keys[order], idx[order].astype(np.int64)
    same = k[1:] == k[:-1]
    if not same.any():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    pos = np.arange(k.size)
    first = np.where(np.concatenate(([True], ~same)), pos, 0)
    np.maximum.accumulate(first, out=first)
    member = np.flatnonzero(same) + 1  # positions that are not the first of their bucket
    far = member[first[member] != member - 1]
    i = np.concatenate((d[member - 1], d[first[far]]))
    j = np.concatenate((d[member], d[far]))
    return i, j


class _UnionFind:
    """Union-find over document numbers; a root is the member first in corpus order."""

    def __init__(self, n: int, rank: np.ndarray | None):
        self.parent = array("q", range(n))
        self.rank = rank  # None: document number order is corpus order

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, x: int, y: int) -> bool:
        rx, ry = self.find(x), self.find(y)
        if rx == ry:
            return False
        earlier = rx < ry if self.rank is None else self.rank[rx] < self.rank[ry]
        if earlier:
            self.parent[ry] = rx
        else:
            self.parent[rx] = ry
        return True

    def roots(self) -> np.ndarray:
        r = np.frombuffer(self.parent, dtype=np.int64).copy()
        while True:
            nxt = r[r]
            if np.array_equal(nxt, r):
                return r
            r = nxt


class MinHashDedup(CorpusStage):
    """MinHash-LSH near-duplicate removal; keeps the first document of each cluster."""

    name: ClassVar[str] = "dedup_minhash"
    Params: ClassVar[type[StageParams]] = Params
    filters: ClassVar[bool] = True
    # lenient: only candidates with identical signatures merge; strict: FineWeb's banding (~0.72) verified
    # at the default 0.7 (a lower threshold finds few more pairs: the bands rarely make them candidates)
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("threshold", 1.0, 0.7),)

    DB = "dedup_minhash.sqlite"

    def signature(self, doc: Doc) -> MinHashSignature | None:
        p: Params = self.params  # type: ignore[assignment]
        h = hasher_for(p)
        shingles = h.shingle_hashes(doc.text)
        if shingles.size == 0:
            return None
        exact = np.unique(shingles) if p.verify == "exact" else None
        return MinHashSignature(h.minhash(shingles), exact)

    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        p: Params = self.params  # type: ignore[assignment]
        h = hasher_for(p)
        workdir = Path(workdir)
        with docindex.begin_plan(workdir, self.DB, self.name) as (scratch, index):
            n, empty, sorted_keys = self._write_records(signatures, scratch, index, h)
            rank = None if sorted_keys else self._corpus_rank(scratch, n)
            uf = _UnionFind(n, rank)
            sigs = (
                np.memmap(scratch / "minhash.u32", dtype=np.uint32, mode="r", shape=(n, h.num_hashes))
                if n
                else None
            )
            exact = self._open_exact(scratch, n) if p.verify == "exact" else None
            candidates = verified = 0
            for band in range(p.bands):
                for i, j in self._band_pairs(scratch / f"band_{band:03d}.rec", p.sort_memory_mb):
                    c, v = self._verify_and_merge(i, j, sigs, exact, uf, p.threshold)
                    candidates += c
                    verified += v
            roots = uf.roots() if n else np.zeros(0, dtype=np.int64)
            dropped = np.flatnonzero(roots != np.arange(n))
            similarity = self._similarity(dropped, roots[dropped], sigs, exact)
            index.add_links(zip(dropped.tolist(), roots[dropped].tolist(), similarity, strict=True))
        clusters = int(np.unique(roots[dropped]).size)
        log.info("dedup_minhash: %d documents, %d duplicates in %d clusters", n, dropped.size, clusters)
        return {
            "documents": n,
            "empty": empty,
            "candidate_pairs": candidates,
            "verified_pairs": verified,
            "clusters": clusters,
            "duplicates": int(dropped.size),
            "ngram": p.ngram,
            "bands": p.bands,
            "rows": p.rows,
            "threshold": p.threshold,
            "verify": p.verify,
            "lsh_threshold": round(lsh_threshold(p.bands, p.rows), 4),
            "detection_curve": detection_curve(p.bands, p.rows),
        }

    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        row = docindex.lookup(
            Path(workdir) / self.DB,
            doc.id,
            "SELECT k.id, l.value FROM docs d JOIN links l ON l.idx = d.idx JOIN docs k ON k.idx = l.other "
            "WHERE d.id = ?",
        )
        if row is None:
            return doc
        return self.drop("duplicate", duplicate_of=row[0], value=row[1], threshold=self.params.threshold)

    # --- plan internals ---------------------------------------------------------------------------

    def _write_records(
        self,
        signatures: Iterable[tuple[Doc | None, Any]],
        scratch: Path,
        index: docindex.DocIndexWriter,
        h: MinHasher,
    ) -> tuple[int, int, bool]:
        """Streams the signatures to disk: MinHash rows, keys, per-band bucket records, ids."""
        p: Params = self.params  # type: ignore[assignment]
        bands = [open(scratch / f"band_{b:03d}.rec", "wb") for b in range(p.bands)]  # noqa: SIM115
        sig_f = open(scratch / "minhash.u32", "wb")  # noqa: SIM115
        key_f = open(scratch / "keys.i64", "wb")  # noqa: SIM115
        sh_f = open(scratch / "shingles.u64", "wb") if p.verify == "exact" else None  # noqa: SIM115
        offsets = array("q", [0])
        n = empty = 0
        last_key: tuple[int, int, int] | None = None
        sorted_keys = True
        batch: list[tuple[Doc | None, Any]] = []

        def flush() -> None:
            nonlocal n, empty, last_key, sorted_keys
            rows = np.zeros((len(batch), h.num_hashes), dtype=np.uint32)
            ok = np.zeros(len(batch), dtype=bool)
            ids, keys = [], []
            for r, (ref, sig) in enumerate(batch):
                key = tuple(ref.key) if ref is not None else (0, 0, 0)
                if last_key is not None and key < last_key:
                    sorted_keys = False
                last_key = key
                keys.append(key)
                ids.append((n + r, ref.id if ref is not None else f"#{n + r}", None, None))
                if sig is None:
                    empty += 1
                    if sh_f is not None:
                        offsets.append(offsets[-1])
                    continue
                if sig.minhash.shape != (h.num_hashes,):
                    raise DataError(
                        f"dedup_minhash: a signature has {sig.minhash.size} values, expected {h.num_hashes}; "
                        "signatures and plan must use the same bands/rows"
                    )
                rows[r] = sig.minhash
                ok[r] = True
                if sh_f is not None:
                    sh_f.write(sig.shingles.tobytes())
                    offsets.append(offsets[-1] + sig.shingles.size)
            sig_f.write(rows.tobytes())
            key_f.write(np.asarray(keys, dtype=np.int64).reshape(-1, 3).tobytes())
            index.add(ids)
            where = np.flatnonzero(ok)
            if where.size:
                bk = h.band_keys(rows[where])
                rec = np.empty(where.size, dtype=_RECORD)
                rec["idx"] = where + n
                for b, f in enumerate(bands):
                    rec["key"] = bk[:, b]
                    f.write(rec.tobytes())
            n += len(batch)
            batch.clear()
            if n > _MAX_DOCS:
                raise DataError(
                    f"dedup_minhash: more than {_MAX_DOCS} documents in one plan; split the corpus"
                )

        try:
            for item in signatures:
                batch.append(item)
                if len(batch) >= 8192:
                    flush()
            if batch:
                flush()
        finally:
            for f in (*bands, sig_f, key_f, *([sh_f] if sh_f else [])):
                f.close()
        if sh_f is not None:
            np.frombuffer(offsets, dtype=np.int64).tofile(scratch / "offsets.i64")
        return n, empty, sorted_keys

    @staticmethod
    def _similarity(
        a: np.ndarray,
        b: np.ndarray,
        sigs: np.ndarray | None,
        exact: tuple[np.ndarray, np.ndarray] | None,
    ) -> list[float]:
        """Similarity of each pair ``(a[k], b[k])`` (a duplicate and its kept document), measured as
        verification measures it: exact Jaccard of the shingle sets, else the signatures' estimate."""
        if a.size == 0:
            return []
        if exact is not None:
            offsets, data = exact
            out = []
            for x, y in zip(a.tolist(), b.tolist(), strict=True):
                sa = data[offsets[x] : offsets[x + 1]]
                sb = data[offsets[y] : offsets[y + 1]]
                inter = np.intersect1d(sa, sb, assume_unique=True).size
                out.append(inter / (sa.size + sb.size - inter))
            return out
        assert sigs is not None
        step = 65536
        return [
            v
            for s in range(0, a.size, step)
            for v in (sigs[a[s : s + step]] == sigs[b[s : s + step]]).mean(axis=1).tolist()
        ]

    @staticmethod
    def _corpus_rank(scratch: Path, n: int) -> np.ndarray:
        """Rank of each document in corpus order (by key, ties by arrival); only when not already sorted."""
        keys = np.fromfile(scratch / "keys.i64", dtype=np.int64).reshape(n, 3)
        order = np.lexsort((np.arange(n), keys[:, 2], keys[:, 1], keys[:, 0]))
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        return rank

    @staticmethod
    def _open_exact(scratch: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.fromfile(scratch / "offsets.i64", dtype=np.int64)
        size = int(offsets[-1]) if n else 0
        data = (
            np.memmap(scratch / "shingles.u64", dtype=np.uint64, mode="r", shape=(size,))
            if size
            else np.zeros(0, np.uint64)
        )
        return offsets, data

    @staticmethod
    def _band_pairs(path: Path, memory_mb: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Candidate pairs of one band, sorted in memory or by key-range partitions that fit ``memory_mb``."""
        budget = memory_mb * 2**20
        n = path.stat().st_size // _RECORD.itemsize
        per_record = 40  # the records, the sort order, the sorted copies
        if n * per_record <= budget:
            rec = np.fromfile(path, dtype=_RECORD)
            yield bucket_pairs(rec["key"], rec["idx"])
            return
        parts = 1 << int(np.ceil(np.log2(n * per_record / budget)))
        shift = np.uint64(64 - int(np.log2(parts)))
        part_paths = [path.with_name(f"{path.name}.{q:05d}") for q in range(parts)]
        outs = [open(pp, "wb") for pp in part_paths]  # noqa: SIM115
        try:
            chunk = max(1, budget // (4 * _RECORD.itemsize))
            with open(path, "rb") as f:
                while True:
                    rec = np.fromfile(f, dtype=_RECORD, count=chunk)
                    if rec.size == 0:
                        break
                    part = (rec["key"] >> shift).astype(np.int64)
                    order = np.argsort(part, kind="stable")
                    bounds = np.searchsorted(part[order], np.arange(parts + 1))
                    for q in range(parts):
                        if bounds[q + 1] > bounds[q]:
                            outs[q].write(rec[order[bounds[q] : bounds[q + 1]]].tobytes())
        finally:
            for o in outs:
                o.close()
        path.unlink()
        for pp in part_paths:
            rec = np.fromfile(pp, dtype=_RECORD)
            pp.unlink()
            if rec.size > 1:
                yield bucket_pairs(rec["key"], rec["idx"])

    @staticmethod
    def _verify_and_merge(
        i: np.ndarray,
        j: np.ndarray,
        sigs: np.ndarray | None,
        exact: tuple[np.ndarray, np.ndarray] | None,
        uf: _UnionFind,
        threshold: float,
    ) -> tuple[int, int]:
        """Merges the pairs whose similarity reaches ``threshold``; returns (pairs checked, pairs passed)."""
        if i.size == 0:
            return 0, 0
        n = max(1, int(sigs.shape[0])) if sigs is not None else 1
        pair = np.unique(i * n + j)  # the same pair from several buckets of this band is checked once
        i, j = pair // n, pair % n
        checked = passed = 0
        if exact is None:
            step = 65536
            for s in range(0, i.size, step):
                a, b = i[s : s + step], j[s : s + step]
                est = (sigs[a] == sigs[b]).mean(axis=1)
                ok = est >= threshold
                checked += a.size
                passed += int(ok.sum())
                for x, y in zip(a[ok].tolist(), b[ok].tolist(), strict=True):
                    uf.union(x, y)
            return checked, passed
        offsets, data = exact
        for x, y in zip(i.tolist(), j.tolist(), strict=True):
            if uf.find(x) == uf.find(y):
                continue  # already together through verified pairs
            checked += 1
            sa = data[offsets[x] : offsets[x + 1]]
            sb = data[offsets[y] : offsets[y + 1]]
            inter = np.intersect1d(sa, sb, assume_unique=True).size
            if inter / (sa.size + sb.size - inter) >= threshold:
                passed += 1
                uf.union(x, y)
        return checked, passed
