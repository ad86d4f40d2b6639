"""``lmforge data``: run a pipeline of stages over sharded input, resumably, on an executor.

The input is planned once into **shards** (:func:`plan_shards`): files are grouped, and large plain
JSONL / parquet files cut, into pieces of about ``execution.chunk_bytes``, in corpus order (source,
file, line). The stage list is cut at each corpus stage into **passes**::

    pass 0:  read -> doc stages ...           -> signatures of corpus stage 1 (+ surviving documents)
    plan 1:  corpus stage 1 decides over all signatures, in corpus order (one process)
    pass 1:  apply corpus stage 1 -> doc stages ... -> signatures of corpus stage 2 ...
    pass K:  apply corpus stage K -> doc stages ... -> OUT/kept, OUT/removed

Every (pass, shard) is one task that streams its shard, writes its files under temporary names,
renames them, and then writes a completion marker holding its counts (``work/pass-K/NNNNN.done``).
Tasks are pure functions of the plan, so a killed run started again skips the marked tasks and
produces the same files; the executor (worker processes or Ray, :mod:`lmforge.corpus.executors`) only
decides where tasks run. ``report.json`` is the sum of the markers.

**Stage errors.** An exception inside a stage removes that document (reason ``<stage>.error``); each
marker counts, per stage, the documents the stage was given (for a corpus stage: in its signature
pass), its errors and its first error (the traceback's frame in the stage's code). After every pass,
once all its shards are done, the driver sums the markers of the passes so far; a stage with more
errors than ``execution.max_error_fraction`` of its documents stops the run with
:class:`StageErrorBudget` (one line, exit status 2). Checking sums of whole passes makes the outcome
independent of the number of workers and of the order shards finish in (the price: a broken stage
is noticed at the end of its pass, not at its first error). Before raising, the driver forgets the
failing stage's work and what followed it: the markers of every pass from the stage's first one (a
per-document stage's only pass; a corpus stage's signature pass) on, the plans of the corpus stages
from there on, and ``report.json``. The intent is written first (``work/redo.json``), so a run killed
while forgetting finishes the job when started again. The same command, once the stage is fixed,
reuses the earlier passes and redoes the rest, giving the output of a run that never failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from lmforge.corpus import readers
from lmforge.corpus.config import PipelineConfig, PipelineSource, StageSpec, build_pipeline_config
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.readers import Piece, ReadOptions
from lmforge.corpus.stages.base import CorpusStage, DocStage
from lmforge.errors import DataError, UserError
from lmforge.progress import Progress

if TYPE_CHECKING:
    from lmforge.corpus.executors import Executor

log = logging.getLogger(__name__)

PLAN_VERSION = 3  # 2: markers count stage errors; 3: removed records carry value and threshold
WORK = "work"


# ---------------------------------------------------------------------------------------------------------
# the stages, grouped into passes


@dataclass
class Slot:
    """One configured stage: a unique label, its instance and the domains it applies to."""

    label: str
    spec: StageSpec
    stage: DocStage | CorpusStage

    def applies(self, doc: Doc) -> bool:
        return self.spec.domains is None or doc.domain in self.spec.domains


class Stages:
    """The configured stages cut into passes: ``segments[k]`` doc stages run after ``corpus[k - 1]``."""

    def __init__(self, cfg: PipelineConfig):
        self.segments: list[list[Slot]] = [[]]
        self.corpus: list[Slot] = []
        self.labels: list[str] = ["read"]
        self.first_pass: dict[str, int] = {}  # the pass a stage first sees documents in
        seen: dict[str, int] = {}
        for spec in cfg.stages:
            seen[spec.name] = seen.get(spec.name, 0) + 1
            label = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
            slot = Slot(label, spec, spec.build())
            self.labels.append(label)
            self.first_pass[label] = len(self.segments) - 1
            if isinstance(slot.stage, CorpusStage):
                self.corpus.append(slot)
                self.segments.append([])
            else:
                self.segments[-1].append(slot)

    @property
    def passes(self) -> int:
        return len(self.corpus) + 1


# ---------------------------------------------------------------------------------------------------------
# planning the shards


def plan_shards(cfg: PipelineConfig) -> tuple[list[list[Piece]], list[list[Any]]]:
    """Shards (lists of pieces, in corpus order) and the input listing ``[path, size, mtime_ns]``."""
    pieces: list[Piece] = []
    inputs: list[list[Any]] = []
    for i, source in enumerate(cfg.sources):
        if readers.builtin_corpus(source.path, f"sources[{i}].path"):
            pieces.extend(_builtin_pieces(i))
            continue
        files = readers.expand_paths(source.path, f"sources[{i}].path")
        for j, path in enumerate(files):
            fmt = source.format if source.format != "auto" else (readers.detect_format(path) or "unknown")
            if fmt == "parquet":
                with contextlib.suppress(Exception):  # a damaged file is reported when read
                    readers.check_parquet_column(path, source.text_field, f"sources[{i}].text_field")
            st = path.stat()
            inputs.append([str(path), st.st_size, st.st_mtime_ns])
            pieces.extend(readers.plan_pieces(i, j, path, fmt, cfg.execution.chunk_bytes))
    shards: list[list[Piece]] = []
    size = cfg.execution.chunk_bytes
    for piece in pieces:
        if size + piece.size > cfg.execution.chunk_bytes and (not shards or shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(piece)
        size += piece.size
    return shards, inputs


def _builtin_pieces(i: int) -> list[Piece]:
    """``builtin:pystdlib``: a piece per standard-library file, then one for the pydoc topics."""
    from lmforge.corpus.pystdlib import stdlib_files, topics_file

    files = stdlib_files()
    out = [Piece(i, j, str(p), "pystdlib", size=p.stat().st_size) for j, p in enumerate(files)]
    topics = topics_file()  # None where pydoc_data is stripped: the piece then reads nothing
    size = topics.stat().st_size if topics is not None else 0
    return [*out, Piece(i, len(files), "pydoc_data.topics", "pystdlib_topics", size=size)]


def _read(piece: Piece, source: PipelineSource) -> Iterator[Doc | tuple[Doc, Drop]]:
    if piece.fmt in ("pystdlib", "pystdlib_topics"):
        from lmforge.corpus.pystdlib import read_stdlib_file, read_topics

        docs = read_stdlib_file(Path(piece.path)) if piece.fmt == "pystdlib" else read_topics()
        for n, d in enumerate(docs):
            yield Doc(d.id, d.text, source.domain or d.domain, (piece.source, piece.file, n))
        return
    opts = ReadOptions(
        domain=source.domain or "default",
        text_field=source.text_field,
        id_field=source.id_field,
        format_field=source.format_field,
        content_format=source.content_format,
    )
    yield from readers.read_piece(piece, opts)


# ---------------------------------------------------------------------------------------------------------
# the output folder


class Layout:
    """Paths inside OUT."""

    def __init__(self, out: str | Path, compression: str = "zstd"):
        self.out = Path(out)
        self.work = self.out / WORK
        self.kept = self.out / "kept"
        self.removed = self.out / "removed"
        self.plan = self.work / "plan.json"
        self.redo = self.work / "redo.json"
        self.report = self.out / "report.json"
        self.tokens = self.out / "tokens"
        self.suffix = ".jsonl.zst" if compression == "zstd" else ".jsonl"

    def pass_dir(self, k: int) -> Path:
        return self.work / f"pass-{k}"

    def marker(self, k: int, shard: int) -> Path:
        return self.pass_dir(k) / f"{shard:05d}.done"

    def stage_dir(self, k: int) -> Path:
        return self.work / f"corpus-{k}"

    def kept_file(self, shard: int) -> Path:
        return self.kept / f"{shard:05d}{self.suffix}"

    def removed_file(self, shard: int) -> Path:
        return self.removed / f"{shard:05d}{self.suffix}"


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Write ``report.json`` atomically."""
    _atomic_json(path, report)


def _atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def prepare_out(cfg: PipelineConfig, out: Path) -> dict[str, Any]:
    """Create OUT's plan, or check that the one there belongs to this configuration and input."""
    lay = Layout(out, cfg.output.compression)
    if lay.plan.is_file():
        plan = json.loads(lay.plan.read_text())
        if plan.get("version") != PLAN_VERSION or plan.get("fingerprint") != cfg.fingerprint():
            raise UserError(
                f"--out {out}: holds a run of a different pipeline configuration (or lmforge version); "
                "give a new --out folder or delete this one"
            )
        for path, size, mtime in plan["inputs"]:
            p = Path(path)
            if not p.is_file() or p.stat().st_size != size or p.stat().st_mtime_ns != mtime:
                raise DataError(
                    f"{path}: input changed since the run in {out} started; delete {out} or use a new --out"
                )
        log.info("data: continuing the run in %s", out)
        return plan
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out}: exists and is not an lmforge data folder; give a new or empty folder")
    shards, inputs = plan_shards(cfg)
    plan = {
        "version": PLAN_VERSION,
        "fingerprint": cfg.fingerprint(),
        "config": cfg.to_tree(),
        "inputs": inputs,
        "shards": [[p.to_json() for p in shard] for shard in shards],
    }
    lay.work.mkdir(parents=True, exist_ok=True)
    _atomic_json(lay.plan, plan)
    return plan


# ---------------------------------------------------------------------------------------------------------
# one task: one pass over one shard


@dataclass
class Context:
    """What a worker needs, loaded from OUT once per process."""

    cfg: PipelineConfig
    stages: Stages
    shards: list[list[Piece]]
    lay: Layout


_CONTEXTS: dict[tuple[str, int], Context] = {}


def load_context(out: str | Path) -> Context:
    lay = Layout(out)
    stamp = lay.plan.stat().st_mtime_ns
    key = (str(Path(out).resolve()), stamp)
    if key not in _CONTEXTS:
        plan = json.loads(lay.plan.read_text())
        cfg = build_pipeline_config(plan["config"])
        shards = [[Piece(**p) for p in shard] for shard in plan["shards"]]
        _CONTEXTS.clear()
        _CONTEXTS[key] = Context(cfg, Stages(cfg), shards, Layout(out, cfg.output.compression))
    return _CONTEXTS[key]


def _nbytes(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class ShardStats:
    """Counts of one task, written into its marker and summed into ``report.json``."""

    def __init__(self, labels: list[str], listed: int):
        self.stages = {
            label: {"docs_in": 0, "bytes_in": 0, "docs_out": 0, "bytes_out": 0, "removed": {}}
            for label in labels
        }
        self.sources: dict[str, dict[str, int]] = {}
        self.bad_input: list[dict[str, Any]] = []
        self.meta: dict[str, int] = {}
        self.domains: dict[str, int] = {}
        self.listed = listed
        self.errors: dict[str, dict[str, Any]] = {
            label: {"documents": 0, "errors": 0, "first": None} for label in labels[1:]
        }

    def source(self, doc: Doc) -> dict[str, int]:
        return self.sources.setdefault(str(doc.key[0]), {"input": 0, "kept": 0, "removed": 0})

    def passed(self, label: str, n_in: int, n_out: int | None) -> None:
        st = self.stages[label]
        st["docs_in"] += 1
        st["bytes_in"] += n_in
        if n_out is not None:
            st["docs_out"] += 1
            st["bytes_out"] += n_out

    def removed(self, label: str, doc: Doc, drop: Drop) -> None:
        reasons = self.stages[label]["removed"]
        reasons[drop.reason] = reasons.get(drop.reason, 0) + 1
        self.source(doc)["removed"] += 1
        if label == "read" and len(self.bad_input) < self.listed:
            self.bad_input.append(
                {"file": doc.meta.get("file"), "line": doc.meta.get("line"), "reason": drop.reason}
            )

    def given(self, label: str) -> None:
        """One document handed to the stage ``label`` (the measure of its error budget)."""
        self.errors[label]["documents"] += 1

    def error(self, slot: Slot, doc: Doc, exc: Exception) -> None:
        """The stage of ``slot`` raised on ``doc``: counted; the shard's first is kept with its file and line."""
        counts = self.errors[slot.label]
        counts["errors"] += 1
        text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if counts["first"] is not None:
            log.debug("stage %s failed on %s (%s); removed it", slot.label, doc.id, text)
            return
        file, line = _stage_frame(slot.stage, exc)
        counts["first"] = {"file": file, "line": line, "error": text, "doc": doc.id}
        log.warning(
            "stage %s failed on %s at %s:%d (%s); removed it (more of its errors in this shard: debug log)",
            slot.label,
            doc.id,
            file,
            line,
            text,
        )

    def kept(self, doc: Doc) -> None:
        self.source(doc)["kept"] += 1
        self.domains[doc.domain] = self.domains.get(doc.domain, 0) + 1
        _add_counters(self.meta, doc.meta, "")

    def to_json(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "sources": self.sources,
            "bad_input": self.bad_input,
            "meta": self.meta,
            "domains": self.domains,
            "errors": self.errors,
        }


def _add_counters(into: dict[str, int], meta: dict[str, Any], prefix: str) -> None:
    """Sum integer ``meta`` values (nested dicts flattened to dotted keys): PII counts and the like."""
    for key, value in meta.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            into[prefix + key] = into.get(prefix + key, 0) + value
        elif isinstance(value, dict):
            _add_counters(into, value, f"{prefix}{key}.")


def _removed_record(doc: Doc, drop: Drop, text: bool = False) -> str:
    """One line of ``OUT/removed``: who, which rule, what it measured against which bound; with
    ``text`` (``output.removed_text``) also the document's text as the removing stage saw it."""
    rec: dict[str, Any] = {"id": doc.id, "domain": doc.domain, "source": doc.key[0], "reason": drop.reason}
    if drop.duplicate_of is not None:
        rec["duplicate_of"] = drop.duplicate_of
    rec["value"] = drop.value
    rec["threshold"] = drop.threshold
    if drop.reason.startswith("read."):
        rec["file"] = doc.meta.get("file")
        rec["line"] = doc.meta.get("line")
    if text:
        rec["text"] = doc.text
    return json.dumps(rec, ensure_ascii=False) + "\n"


def _kept_record(doc: Doc) -> str:
    meta = {k: v for k, v in doc.meta.items() if k != "raw"}  # raw file bytes stay out of JSON
    rec = {"id": doc.id, "domain": doc.domain, "text": doc.text, "meta": meta}
    return json.dumps(rec, ensure_ascii=False, default=str) + "\n"


class _TextSink:
    """A JSONL file written under a temporary name (zstd-compressed or plain); ``commit`` renames it."""

    def __init__(self, path: Path, level: int | None):
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._raw = self.tmp.open("wb")
        self._fh: IO[bytes]
        if level is None:
            self._fh = self._raw
        else:
            import zstandard

            self._fh = zstandard.ZstdCompressor(level=level).stream_writer(self._raw, closefd=False)

    def write(self, line: str) -> None:
        self._fh.write(line.encode("utf-8"))

    def commit(self) -> None:
        if self._fh is not self._raw:
            self._fh.close()
        self._raw.close()
        os.replace(self.tmp, self.path)


def _pickles(path: Path) -> Iterator[Any]:
    with path.open("rb") as fh:
        while True:
            try:
                yield pickle.load(fh)
            except EOFError:
                return


def _safe(slot: Slot, doc: Doc, stats: ShardStats, fn: Callable[[], Doc | Drop]) -> Doc | Drop:
    """A stage's answer; an exception inside a stage removes the document (``<stage>.error``), counted."""
    try:
        return fn()
    except Exception as exc:
        stats.error(slot, doc, exc)
        return Drop(f"{slot.spec.name}.error")


def _stage_frame(stage: object, exc: BaseException) -> tuple[str, int]:
    """File and line of the innermost traceback frame in the stage's own code (its class or a base).

    An exception raised inside a library the stage calls is reported at the stage's line that called
    it; if no frame is in the stage's code, the innermost frame.
    """
    files = set()
    for cls in type(stage).__mro__:
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if path and cls.__module__ not in ("builtins", "abc"):
            files.add(os.path.realpath(path))
    frames = traceback.extract_tb(exc.__traceback__)
    frame = next((f for f in reversed(frames) if os.path.realpath(f.filename) in files), frames[-1])
    return frame.filename, frame.lineno or 0


def run_task(out: str, k: int, shard: int) -> None:
    """Pass ``k`` over shard ``shard`` of the run in ``out``; does nothing if its marker exists."""
    ctx = load_context(out)
    lay = ctx.lay
    marker = lay.marker(k, shard)
    if marker.exists():
        return
    lay.pass_dir(k).mkdir(parents=True, exist_ok=True)
    stats = ShardStats(ctx.stages.labels, ctx.cfg.output.bad_input_listed)
    last = k == ctx.stages.passes - 1
    level = ctx.cfg.output.zstd_level if ctx.cfg.output.compression == "zstd" else None
    base = lay.pass_dir(k) / f"{shard:05d}"
    if last:
        kept = _TextSink(lay.kept_file(shard), level)
        removed = _TextSink(lay.removed_file(shard), level)
        for j in range(k):  # removals of earlier passes first, so the file lists them all
            with (lay.pass_dir(j) / f"{shard:05d}.removed.jsonl").open("r", encoding="utf-8") as fh:
                for line in fh:
                    removed.write(line)
    else:
        removed = _TextSink(base.with_suffix(".removed.jsonl"), None)
        docs_tmp = base.with_suffix(".docs.tmp")
        sigs_tmp = base.with_suffix(".sig.tmp")
        docs_fh, sigs_fh = docs_tmp.open("wb"), sigs_tmp.open("wb")
        sig_slot = ctx.stages.corpus[k]

    text = ctx.cfg.output.removed_text
    # since the first document waiting for its signature, in order: removal lines and (input, output,
    # waits) documents; written once the group of ``signature_batch`` waiting documents is complete
    held: list[str | tuple[Doc, Doc, bool]] = []
    waiting = 0
    for doc in _pass_input(ctx, k, shard, stats, removed):
        out_doc = _run_segment(ctx.stages.segments[k], doc, stats)
        if isinstance(out_doc, tuple):
            label, drop, seen = out_doc
            stats.removed(label, doc, drop)
            line = _removed_record(seen, drop, text)
            if held:
                held.append(line)
            else:
                removed.write(line)
            continue
        if last:
            stats.kept(out_doc)
            kept.write(_kept_record(out_doc))
            continue
        waits = sig_slot.applies(out_doc)
        if waits or held:
            held.append((doc, out_doc, waits))
        else:
            pickle.dump(out_doc, docs_fh, protocol=5)
        if waits:
            stats.given(sig_slot.label)
            waiting += 1
            if waiting >= max(1, sig_slot.stage.signature_batch):  # type: ignore[union-attr]
                _write_held(held, sig_slot, stats, removed, docs_fh, sigs_fh, text)
                waiting = 0
    if held:
        _write_held(held, sig_slot, stats, removed, docs_fh, sigs_fh, text)

    if last:
        kept.commit()
        removed.commit()
    else:
        docs_fh.close()
        sigs_fh.close()
        os.replace(docs_tmp, base.with_suffix(".docs"))
        os.replace(sigs_tmp, base.with_suffix(".sig"))
        removed.commit()
    _atomic_json(marker, stats.to_json())


class _Failed:
    """A document's signature that raised."""

    def __init__(self, exc: Exception):
        self.exc = exc


def _signatures(slot: Slot, docs: list[Doc]) -> list[Any]:
    """The stage's signatures of ``docs`` (a group at once, as :meth:`CorpusStage.signatures`); if the
    group raises, each document alone, a failing one as :class:`_Failed`."""
    stage: CorpusStage = slot.stage  # type: ignore[assignment]
    if len(docs) > 1:
        try:
            sigs = stage.signatures(docs)
            if len(sigs) == len(docs):
                return sigs
        except Exception:
            log.debug(
                "stage %s: a group of %d signatures failed; one document at a time", slot.label, len(docs)
            )
    out: list[Any] = []
    for doc in docs:
        try:
            out.append(stage.signature(doc))
        except Exception as exc:
            out.append(_Failed(exc))
    return out


def _write_held(
    held: list,
    slot: Slot,
    stats: ShardStats,
    removed: _TextSink,
    docs_fh: IO[bytes],
    sigs_fh: IO[bytes],
    text: bool,
) -> None:
    """Write ``held`` in order, with the signatures of its waiting documents; a failed signature removes
    its document (``<stage>.error``, counted as :func:`_safe` counts)."""
    sigs = iter(_signatures(slot, [item[1] for item in held if not isinstance(item, str) and item[2]]))
    for item in held:
        if isinstance(item, str):
            removed.write(item)
            continue
        doc, out_doc, waits = item
        if waits:
            sig = next(sigs)
            if isinstance(sig, _Failed):
                stats.error(slot, out_doc, sig.exc)
                drop = Drop(f"{slot.spec.name}.error")
                stats.passed(slot.label, _nbytes(out_doc.text), None)
                stats.removed(slot.label, doc, drop)
                removed.write(_removed_record(out_doc, drop, text))
                continue
            pickle.dump((out_doc.id, out_doc.domain, out_doc.key, sig), sigs_fh, protocol=5)
        pickle.dump(out_doc, docs_fh, protocol=5)
    held.clear()


def _pass_input(ctx: Context, k: int, shard: int, stats: ShardStats, removed: _TextSink) -> Iterator[Doc]:
    """Documents entering pass ``k``: read from the input (k = 0) or left by pass k - 1 after its corpus stage."""
    text = ctx.cfg.output.removed_text
    if k == 0:
        for piece in ctx.shards[shard]:
            source = ctx.cfg.sources[piece.source]
            stats.stages["read"]["bytes_in"] += piece.size
            for item in _read(piece, source):
                doc = item[0] if isinstance(item, tuple) else item
                stats.source(doc)["input"] += 1
                st = stats.stages["read"]
                st["docs_in"] += 1
                if isinstance(item, tuple):
                    stats.removed("read", *item)
                    removed.write(_removed_record(*item, text))
                    continue
                st["docs_out"] += 1
                st["bytes_out"] += _nbytes(doc.text)
                if "encoding" in doc.meta:  # decoded from another encoding than UTF-8 (readers.py)
                    name = f"read.decoded_{doc.meta['encoding']}"
                    stats.meta[name] = stats.meta.get(name, 0) + 1
                yield doc
        return
    slot = ctx.stages.corpus[k - 1]
    workdir = ctx.lay.stage_dir(k - 1) / "data"
    for doc in _pickles(ctx.lay.pass_dir(k - 1) / f"{shard:05d}.docs"):
        n = _nbytes(doc.text)
        if not slot.applies(doc):
            stats.passed(slot.label, n, n)
            yield doc
            continue
        out = _safe(slot, doc, stats, lambda d=doc: slot.stage.apply(d, workdir))  # type: ignore[union-attr]
        if isinstance(out, Drop):
            stats.passed(slot.label, n, None)
            stats.removed(slot.label, doc, out)
            removed.write(_removed_record(doc, out, text))
            continue
        stats.passed(slot.label, n, _nbytes(out.text))
        yield out


def _run_segment(segment: list[Slot], doc: Doc, stats: ShardStats) -> Doc | tuple[str, Drop, Doc]:
    """The doc stages of one pass in order; a removal comes back with the label of the stage that made it
    and the document as that stage was given it."""
    n = _nbytes(doc.text)
    for slot in segment:
        if not slot.applies(doc):
            stats.passed(slot.label, n, n)
            continue
        before = doc.text
        stats.given(slot.label)
        out = _safe(slot, doc, stats, lambda d=doc, s=slot: s.stage.process(d))  # type: ignore[union-attr]
        if isinstance(out, Drop):
            stats.passed(slot.label, n, None)
            return slot.label, out, doc
        m = n if out.text is before else _nbytes(out.text)
        stats.passed(slot.label, n, m)
        doc, n = out, m
    return doc


# ---------------------------------------------------------------------------------------------------------
# corpus stage planning (one process)


def run_corpus_plan(out: str | Path, k: int) -> dict[str, Any]:
    """``plan`` of corpus stage ``k`` over every shard's signatures, in corpus order; marker-guarded."""
    ctx = load_context(out)
    stage_dir = ctx.lay.stage_dir(k)
    marker = stage_dir / "plan.done"
    if marker.is_file():
        return json.loads(marker.read_text())
    shutil.rmtree(stage_dir, ignore_errors=True)  # a plan killed half-way starts over
    (stage_dir / "data").mkdir(parents=True)
    slot = ctx.stages.corpus[k]

    def refs() -> Iterator[tuple[Doc, Any]]:
        for shard in range(len(ctx.shards)):
            for doc_id, domain, key, sig in _pickles(ctx.lay.pass_dir(k) / f"{shard:05d}.sig"):
                yield Doc(doc_id, "", domain, tuple(key)), sig

    log.info("data: planning %s", slot.label)
    figures = slot.stage.plan(refs(), stage_dir / "data")  # type: ignore[union-attr]
    _atomic_json(marker, figures)
    return figures


# ---------------------------------------------------------------------------------------------------------
# the run


def run_pipeline(
    cfg: PipelineConfig,
    out: str | Path,
    executor: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """Run (or continue) the pipeline into ``out``; returns the report also written to ``report.json``."""
    from lmforge.corpus.executors import make_executor

    out = Path(out)
    Stages(
        cfg
    )  # every stage built once first: a missing model or list file stops the run before OUT is written
    plan = prepare_out(cfg, out)
    ctx = load_context(out)
    n = len(plan["shards"])
    kind = executor or cfg.execution.executor
    count = workers if workers is not None else cfg.execution.workers
    log.info("data: %d shards, %d passes, %s executor", n, ctx.stages.passes, kind)
    _finish_forgetting(ctx.lay, n)  # a run killed while forgetting a failed stage's work
    with make_executor(kind, count) as ex:
        for k in range(ctx.stages.passes):
            todo = [i for i in range(n) if not ctx.lay.marker(k, i).exists()]
            if todo:
                _run_pass(ex, ctx, out, k, todo, n)
            check_error_budget(ctx, k, cfg.execution.max_error_fraction)
            if k < ctx.stages.passes - 1:
                run_corpus_plan(out, k)
    report = build_report(ctx, plan)
    _atomic_json(ctx.lay.report, report)
    for path in ctx.lay.work.glob("pass-*/*"):  # intermediate documents and signatures are spent
        if path.suffix in (".docs", ".sig"):
            path.unlink()
    return report


def _run_pass(ex: Executor, ctx: Context, out: Path, k: int, todo: list[int], n: int) -> None:
    """Pass ``k`` over the shards ``todo`` (of ``n``), shown as a phase: the shards finished (their
    markers), the rate and the time left, every few seconds."""
    what = f"data: pass {k + 1}/{ctx.stages.passes}"
    shown = Progress(what, len(todo), "shards", opening=f"{what}: {len(todo)} of {n} shards to do")
    with shown, shown.ticking(poll=lambda: sum(ctx.lay.marker(k, i).exists() for i in todo)):
        ex.run(run_task, [(str(out), k, i) for i in todo])


# ---------------------------------------------------------------------------------------------------------
# the stage error budget


class StageErrorBudget(DataError):
    """A stage raised on more of its documents than ``execution.max_error_fraction`` allows (exit status 2)."""


def stage_errors(ctx: Context, passes: int) -> dict[str, dict[str, Any]]:
    """Per stage label, over the markers of passes ``0 .. passes - 1``: ``documents`` it was given,
    ``count`` of errors, and the ``first`` error in corpus order (pass, then shard) with file and line."""
    totals: dict[str, dict[str, Any]] = {
        label: {"documents": 0, "count": 0, "first": None} for label in ctx.stages.labels[1:]
    }
    for k in range(passes):
        for i in range(len(ctx.shards)):
            for label, e in json.loads(ctx.lay.marker(k, i).read_text())["errors"].items():
                total = totals[label]
                total["documents"] += e["documents"]
                total["count"] += e["errors"]
                if total["first"] is None:
                    total["first"] = e["first"]
    return totals


def allowed_errors(fraction: float, documents: int) -> int:
    """Errors a stage given ``documents`` may make: ``floor(fraction * documents)`` (robust to rounding)."""
    return math.floor(fraction * documents + 1e-9)


def check_error_budget(ctx: Context, k: int, fraction: float) -> None:
    """After pass ``k`` (every shard done): StageErrorBudget for the first stage over its budget.

    Before raising, the failing stage's work and everything after it is forgotten (see the module
    docstring), so the same command redoes it once the stage is fixed.
    """
    totals = stage_errors(ctx, k + 1)
    for label in ctx.stages.labels[1:]:  # stage order: the first stage over budget is reported
        total = totals[label]
        allowed = allowed_errors(fraction, total["documents"])
        if total["count"] <= allowed:
            continue
        first = total["first"]
        _forget(ctx, ctx.stages.first_pass[label])
        raise StageErrorBudget(
            f"stage {label}: {total['count']:,} of the {total['documents']:,} documents it was given raised "
            f"an error, over execution.max_error_fraction = {fraction:g} ({allowed:,} allowed); first at "
            f"{first['file']}:{first['line']} on document {first['doc']}: {first['error']}; fix the stage "
            f"(or raise execution.max_error_fraction) and run the same command again: the work before "
            f"{label} is kept, {label} and what follows are redone"
        )


def _forget(ctx: Context, start: int) -> None:
    """Forget passes ``start ..`` and the plans after them: a later run redoes them.

    The intent is written first (``work/redo.json``), then carried out, so a run killed in between
    finishes the job when started again. A finished run's intermediate documents are spent; then the
    work is redone from the input.
    """
    n = len(ctx.shards)
    if start > 0 and not all((ctx.lay.pass_dir(start - 1) / f"{i:05d}.docs").is_file() for i in range(n)):
        start = 0
    passes = ctx.stages.passes
    _atomic_json(
        ctx.lay.redo, {"passes": list(range(start, passes)), "plans": list(range(start, passes - 1))}
    )
    _finish_forgetting(ctx.lay, n)


def _finish_forgetting(lay: Layout, shards: int) -> None:
    """Carry out ``work/redo.json`` if there is one: delete the report, the listed markers and plans."""
    if not lay.redo.is_file():
        return
    todo = json.loads(lay.redo.read_text())
    lay.report.unlink(missing_ok=True)
    for k in todo["passes"]:
        for i in range(shards):
            lay.marker(k, i).unlink(missing_ok=True)
    for j in todo["plans"]:
        (lay.stage_dir(j) / "plan.done").unlink(missing_ok=True)
    lay.redo.unlink()


# ---------------------------------------------------------------------------------------------------------
# the report


def build_report(ctx: Context, plan: dict[str, Any]) -> dict[str, Any]:
    """Sum the task markers into the run's report (deterministic: no timings)."""
    stages = {
        label: {"docs_in": 0, "bytes_in": 0, "docs_out": 0, "bytes_out": 0, "removed": {}}
        for label in ctx.stages.labels
    }
    sources = {str(i): {"input": 0, "kept": 0, "removed": 0} for i in range(len(ctx.cfg.sources))}
    meta: dict[str, int] = {}
    domains: dict[str, int] = {}
    bad: list[dict[str, Any]] = []
    bad_count = 0
    for k in range(ctx.stages.passes):
        for i in range(len(ctx.shards)):
            m = json.loads(ctx.lay.marker(k, i).read_text())
            for label, st in m["stages"].items():
                total = stages[label]
                for key in ("docs_in", "bytes_in", "docs_out", "bytes_out"):
                    total[key] += st[key]
                for reason, c in st["removed"].items():
                    total["removed"][reason] = total["removed"].get(reason, 0) + c
            for s, counts in m["sources"].items():
                for key, c in counts.items():
                    sources[s][key] += c
            for key, c in m["meta"].items():
                meta[key] = meta.get(key, 0) + c
            for key, c in m["domains"].items():
                domains[key] = domains.get(key, 0) + c
            bad.extend(m["bad_input"])
            bad_count += sum(m["stages"]["read"]["removed"].values()) if k == 0 else 0
    errors = stage_errors(ctx, ctx.stages.passes)
    stage_rows = []
    for label in ctx.stages.labels:
        row: dict[str, Any] = {"stage": label, **stages[label]}
        row["removed"] = dict(sorted(row["removed"].items()))
        if label in errors:
            row["errors"] = errors[label]
        slot = next((s for s in ctx.stages.corpus if s.label == label), None)
        spec = (
            slot.spec
            if slot
            else next((s.spec for seg in ctx.stages.segments for s in seg if s.label == label), None)
        )
        if spec is not None and spec.domains is not None:
            row["domains"] = spec.domains
        if slot is not None:
            row["plan"] = json.loads(
                (ctx.lay.stage_dir(ctx.stages.corpus.index(slot)) / "plan.done").read_text()
            )
        stage_rows.append(row)
    reasons: dict[str, int] = {}
    for st in stages.values():
        for reason, c in st["removed"].items():
            reasons[reason] = reasons.get(reason, 0) + c
    src_rows = [
        {"source": i, "path": s.path, "domain": s.domain, **sources[str(i)]}
        for i, s in enumerate(ctx.cfg.sources)
    ]
    last = stage_rows[-1]
    return {
        "fingerprint": plan["fingerprint"],
        "shards": len(ctx.shards),
        "documents": {
            "input": sum(s["input"] for s in src_rows),
            "kept": sum(s["kept"] for s in src_rows),
            "removed": sum(s["removed"] for s in src_rows),
        },
        "bytes": {"input": stages["read"]["bytes_in"], "kept": last["bytes_out"]},
        "sources": src_rows,
        "stages": stage_rows,
        "removed": dict(sorted(reasons.items())),
        "kept_by_domain": dict(sorted(domains.items())),
        "meta": dict(sorted(meta.items())),
        "bad_input": {"count": bad_count, "listed": bad[: ctx.cfg.output.bad_input_listed]},
    }


# ---------------------------------------------------------------------------------------------------------
# the kept documents of a finished run (tokenized by lmforge.data.tokenize_output)


def kept_files(out: str | Path) -> list[Path]:
    """``OUT/kept``'s files in corpus (shard) order."""
    return [p for p in sorted(Layout(out).kept.glob("*.jsonl*")) if not p.name.endswith(".tmp")]


def iter_kept(out: str | Path) -> Iterator[Doc]:
    """The kept documents of a finished run, in corpus order (``id``, ``text``, ``domain``)."""
    for path in kept_files(out):
        for rec in readers.json_records(path):
            yield Doc(rec["id"], rec["text"], rec["domain"])


def kept_fingerprint(out: str | Path) -> str:
    """SHA-256 over the names and contents of the kept files: changes whenever the kept documents do."""
    h = hashlib.sha256()
    for path in kept_files(out):
        h.update(path.name.encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()
