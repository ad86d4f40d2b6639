"""What a finished ``lmforge data`` run removed, rule by rule (``lmforge data inspect``).

Counts come from ``OUT/report.json`` (every removal, summed by reason); samples are the first matching
records of ``OUT/removed`` in shard order, so the same command shows the same documents every time. A
rule is named exactly (``c4.too_few_sentences``) or by a prefix of reasons (``c4``: every ``c4.*``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.corpus import readers
from lmforge.corpus.pipeline import Layout
from lmforge.errors import DataError, UserError


@dataclass
class RuleSamples:
    """The removals of the reasons matching ``rule``: counts per reason, the first records, and what a
    reader needs to show them (whether the run kept the text, the sources' paths)."""

    rule: str
    counts: dict[str, int]
    samples: list[dict[str, Any]] = field(default_factory=list)
    text_kept: bool = False
    sources: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _finished_run(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(plan, report) of the finished run in ``out``; DataError naming OUT and the fix otherwise."""
    lay = Layout(out)
    if not lay.plan.is_file():
        what = (
            "does not exist"
            if not out.exists()
            else "is not an lmforge data output folder (no work/plan.json)"
        )
        raise DataError(f"OUT {out}: {what}; give the --out folder of a `lmforge data` run")
    if not lay.report.is_file():
        raise DataError(
            f"OUT {out}: the run has not finished (no report.json); run the same `lmforge data` command "
            "again to finish it, then inspect"
        )
    return json.loads(lay.plan.read_text()), json.loads(lay.report.read_text())


def matching(reasons: dict[str, int], rule: str) -> dict[str, int]:
    """The reasons (with their counts) that ``rule`` names: itself, or every reason starting with it."""
    return {r: c for r, c in sorted(reasons.items()) if c and r.startswith(rule)}


def sample_removals(out: str | Path, rule: str, n: int) -> RuleSamples:
    """Counts of the reasons matching ``rule`` in the finished run ``out`` and its first ``n`` records.

    UserError (one line) when ``out`` is not a finished run, ``n`` is below 1, or no removal matches
    ``rule`` (the message lists the reasons present).
    """
    out = Path(out)
    if n < 1:
        raise UserError(f"--n: give how many samples to show, at least 1 (got {n})")
    plan, report = _finished_run(out)
    present = {r: c for r, c in report["removed"].items() if c}
    counts = matching(present, rule)
    if not counts:
        raise UserError(f"--reason {rule}: {_no_match(rule, present, out)}")
    result = RuleSamples(
        rule,
        counts,
        text_kept=bool(plan["config"].get("output", {}).get("removed_text", False)),
        sources=[s["path"] for s in report["sources"]],
    )
    for rec in iter_removed(out):
        if rec["reason"] in counts:
            result.samples.append(rec)
            if len(result.samples) == n:
                break
    return result


def _no_match(rule: str, present: dict[str, int], out: Path) -> str:
    if not present:
        return f"the run in {out} removed no documents"
    close = difflib.get_close_matches(rule, list(present), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    listing = ", ".join(f"{r} ({c:,})" for r, c in sorted(present.items()))
    return (
        f"no document in {out} was removed by a rule of that name or prefix; {hint}rules present: {listing}"
    )


def iter_removed(out: str | Path) -> Iterator[dict[str, Any]]:
    """Every record of ``OUT/removed`` in shard order."""
    for path in sorted(Layout(out).removed.glob("*.jsonl*")):
        if not path.name.endswith(".tmp"):
            yield from readers.json_records(path)


def excerpt(text: str, chars: int, lines: int) -> tuple[str, int]:
    """The start of ``text`` for a terminal: at most ``chars`` characters and ``lines`` lines, cut at a
    space when one is near; returns (the excerpt, characters left out)."""
    head = text[:chars]
    kept = head.split("\n")[:lines]
    head = "\n".join(kept)
    if len(head) < len(text):
        cut = head.rfind(" ", max(0, len(head) - 40))
        if cut > 0 and not text[len(head)].isspace():
            head = head[:cut]
    head = head.rstrip()
    return head, len(text) - len(head)
