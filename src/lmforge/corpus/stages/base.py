"""The contract every pipeline stage of ``lmforge data`` follows.

A stage has a ``name`` (used in removal reasons as ``"<stage>.<rule>"``) and parameters in a pydantic
model (``Params``) declared next to it: its defaults are the published ones and are listed in the data
config reference. There are two kinds:

* :class:`DocStage` sees one document at a time and returns it (possibly changed) or a :class:`Drop`.
  It is a pure function of the document and its parameters, so the executor may run it on any process,
  in any order, and again after a restart.
* :class:`CorpusStage` needs the whole corpus (deduplication). The executor runs it in three phases:
  ``signature`` per document (parallel, the result is pickled to disk), ``plan`` once over all
  signatures in corpus order (single process, bounded memory: it may spill to ``workdir``) and
  ``apply`` per document (parallel, reading what ``plan`` left in ``workdir``).

Documents are :class:`~lmforge.corpus.document.Doc`; corpus order is the order of :attr:`Doc.key`:
deterministic, so "keep the first of a cluster" means the same document on every run and every executor.

**Strictness.** A stage that removes documents by a threshold declares how its thresholds move from
lenient to strict as :class:`Knob` entries in ``strictness``; ``lmforge data sweep`` runs a recipe at
levels 0..100 (:mod:`lmforge.corpus.strictness`): at level 0 no stage with ``filters = True`` runs, at
level ``L > 0`` each knob's parameter is ``lenient + (strict - lenient) * L / 100``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from lmforge.corpus.document import Doc, Drop, Measure


@dataclass(frozen=True)
class Knob:
    """One threshold of a stage and how it moves with strictness.

    ``value(L) = lenient + (strict - lenient) * L / 100`` for a level ``L`` in (0, 100], rounded for
    ``integer`` parameters. ``lenient`` removes (almost) nothing, ``strict`` is the strictest value a
    published recipe uses (the stage's docstring says which). A table of thresholds (``strict`` a dict,
    such as Gopher's n-gram fractions) moves entry by entry from ``lenient``; an on/off rule (both ends
    booleans) takes its strict setting from level 50 on.
    """

    param: str
    lenient: float | bool
    strict: float | bool | dict[int, float]
    integer: bool = False

    def value(self, level: float) -> float | int | bool | dict[int, float]:
        """The parameter's value at strictness ``level`` (0..100)."""
        if isinstance(self.strict, bool):
            return self.strict if level >= 50 else bool(self.lenient)
        if isinstance(self.strict, dict):
            return {n: self.lenient + (v - self.lenient) * level / 100.0 for n, v in self.strict.items()}
        v = self.lenient + (self.strict - self.lenient) * level / 100.0
        return round(v) if self.integer else v


class StageParams(BaseModel):
    """Base of every stage's parameter model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class _Stage(ABC):
    """What both kinds share: a name, parameters, and how a removal is recorded."""

    name: ClassVar[str]
    Params: ClassVar[type[StageParams]] = StageParams
    filters: ClassVar[bool] = False
    """True for a stage whose purpose is removing documents (quality, language, duplicates): it is left
    out at strictness level 0. Stages that change text (extract, normalize, pii) keep ``False``."""
    strictness: ClassVar[tuple[Knob, ...]] = ()
    """The thresholds ``lmforge data sweep`` moves from lenient to strict (empty: fixed at every level)."""

    def __init__(self, params: StageParams | None = None):
        self.params = params if params is not None else self.Params()

    def drop(
        self,
        rule: str,
        duplicate_of: str | None = None,
        *,
        value: Measure = None,
        threshold: Measure = None,
    ) -> Drop:
        """A removal by ``rule`` of this stage, with what the rule measured and the bound it failed."""
        return Drop(f"{self.name}.{rule}", duplicate_of, value, threshold)


class DocStage(_Stage):
    """A per-document stage: ``process(doc) -> Doc | Drop``."""

    @abstractmethod
    def process(self, doc: Doc) -> Doc | Drop: ...


class CorpusStage(_Stage):
    """A stage that decides from the whole corpus: ``signature`` -> ``plan`` -> ``apply``."""

    @abstractmethod
    def signature(self, doc: Doc) -> Any:
        """A picklable summary of ``doc`` (a hash, a MinHash vector, ...); runs in parallel."""

    signature_batch: int = 1
    """How many documents the pipeline hands :meth:`signatures` at once (1: :meth:`signature` per document)."""

    def signatures(self, docs: list[Doc]) -> list[Any]:
        """The signatures of several documents, in order: ``[signature(d) for d in docs]`` up to floating-point
        rounding. A stage whose work batches across documents (a model's forward pass) overrides it and sets
        ``signature_batch``; if it raises, the pipeline calls :meth:`signature` on each document of the group,
        so only a document that fails on its own is removed."""
        return [self.signature(d) for d in docs]

    @abstractmethod
    def plan(self, signatures: Iterable[tuple[Doc | None, Any]], workdir: Path) -> dict[str, Any]:
        """Decide over all ``(doc_ref, signature)`` pairs in corpus order; write decisions under ``workdir``.

        ``doc_ref`` carries ``id``, ``key`` and ``domain`` (``text`` may be empty). Returns figures for
        the report (for example cluster counts).
        """

    @abstractmethod
    def apply(self, doc: Doc, workdir: Path) -> Doc | Drop:
        """The decision for one document, read from ``workdir``; runs in parallel after ``plan``."""


def run_doc_stages(stages: Iterable[DocStage], docs: Iterable[Doc]) -> Iterator[Doc | tuple[Doc, Drop]]:
    """Apply per-document stages in order; yields kept docs, or ``(original doc, Drop)`` for removed ones."""
    stages = list(stages)
    for doc in docs:
        out: Doc | Drop = doc
        for stage in stages:
            out = stage.process(out)
            if isinstance(out, Drop):
                break
        yield out if isinstance(out, Doc) else (doc, out)


def run_corpus_stage(
    stage: CorpusStage, docs: Iterable[Doc], workdir: Path
) -> tuple[list[Doc | tuple[Doc, Drop]], dict[str, Any]]:
    """Run a corpus stage's three phases in one process, in memory (small corpora, tests).

    The pipeline's executors run the same phases in parallel with signatures on disk; this sequential
    form is the reference they must agree with. Returns the per-document outcomes in input order (as
    :func:`run_doc_stages` yields them) and the figures ``plan`` reported.
    """
    docs = list(docs)
    workdir.mkdir(parents=True, exist_ok=True)
    refs = [(Doc(d.id, "", d.domain, d.key), stage.signature(d)) for d in docs]
    figures = stage.plan(iter(refs), workdir)
    outcomes: list[Doc | tuple[Doc, Drop]] = []
    for doc in docs:
        out = stage.apply(doc, workdir)
        outcomes.append(out if isinstance(out, Doc) else (doc, out))
    return outcomes, figures
