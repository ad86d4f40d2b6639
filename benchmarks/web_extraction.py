"""Characters the web recipe extracts from real HTML pages and keeps, before and after joining wrapped lines.

Each page goes through ``lmforge data`` itself (the HTML reader, then every stage of
``configs/data/web.toml``, deduplication included) twice:

* ``before``: the recipe with ``extract.join_wrapped_lines = false`` and C4's
  ``filter_no_terminal_punct`` and ``filter_ellipsis_lines`` back on, which reproduces the recipe as it
  was (the extract stage then hands trafilatura the page string exactly as before);
* ``after``: the recipe as it is.

*Extracted* is the length of the text the recipe's ``extract`` stage gives (a run of that stage alone,
with the variant's settings); *kept* is the length of the page's text in ``OUT/kept`` after the whole
recipe (0 when a stage removed it: the reason is shown). Characters are Unicode code points.

    python benchmarks/web_extraction.py '/usr/share/doc/libffi8/html/*.html' \\
        /usr/share/doc/base-passwd/users-and-groups.html [--excerpt PAGE] [--chars 400]

Prints a Markdown table (one row per page, then the totals), the start of one page's kept text before
and after (``--excerpt``; default: the page with the most extracted text), and as the last line one
JSON object with every figure.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from lmforge.corpus import readers
from lmforge.corpus.config import PipelineConfig, build_pipeline_config, load_pipeline_config
from lmforge.corpus.pipeline import run_pipeline

RECIPE = Path(__file__).parents[1] / "configs" / "data" / "web.toml"
BEFORE = {
    "extract": {"join_wrapped_lines": False},
    "c4": {"filter_no_terminal_punct": True, "filter_ellipsis_lines": True},
}


def pages(patterns: list[str]) -> list[Path]:
    """The files the paths or globs name, each once, sorted."""
    found: set[Path] = set()
    for pattern in patterns:
        matches = glob.glob(pattern, recursive=True) or [pattern]
        found.update(Path(m).resolve() for m in matches if Path(m).is_file())
    if not found:
        raise SystemExit(f"no HTML file matches {' '.join(patterns)}")
    return sorted(found)


def recipe(files: list[Path], changes: dict[str, dict[str, Any]], only: str | None = None) -> PipelineConfig:
    """The web recipe over ``files`` (one source each), its stage parameters updated by ``changes``;
    with ``only``, just that stage."""
    tree = load_pipeline_config(RECIPE).to_tree()
    tree["sources"] = [{"path": str(f), "format": "html", "domain": "web"} for f in files]
    stages = [s | changes.get(s["name"], {}) for s in tree["stages"] if only in (None, s["name"])]
    tree["stages"] = stages
    tree["output"] = {"compression": "none"}
    tree["tokenize"] = {"enabled": False}
    return build_pipeline_config(tree)


def texts(cfg: PipelineConfig, out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Run ``cfg`` into ``out``: (kept text by id, removal reason by id)."""
    run_pipeline(cfg, out, workers=1)
    kept = {
        r["id"]: r["text"] for p in sorted((out / "kept").glob("*.jsonl")) for r in readers.json_records(p)
    }
    removed = {
        r["id"]: r["reason"]
        for p in sorted((out / "removed").glob("*.jsonl"))
        for r in readers.json_records(p)
    }
    return kept, removed


def measure(files: list[Path], work: Path) -> dict[str, dict[str, Any]]:
    """Per variant and page: characters extracted, characters kept, the removal reason (or None)."""
    result: dict[str, dict[str, Any]] = {}
    for variant, changes in (("before", BEFORE), ("after", {})):
        extracted, _ = texts(recipe(files, changes, only="extract"), work / f"{variant}-extract")
        kept, removed = texts(recipe(files, changes), work / f"{variant}-recipe")
        result[variant] = {
            str(f): {
                "extracted": len(extracted.get(str(f), "")),
                "kept": len(kept.get(str(f), "")),
                "removed": removed.get(str(f)),
                "text": kept.get(str(f), ""),
            }
            for f in files
        }
    return result


def table(files: list[Path], result: dict[str, dict[str, Any]]) -> str:
    root = Path(os.path.commonpath([f.parent for f in files]))
    rows = [
        "| page | extracted before | kept before | extracted after | kept after |",
        "|---|---:|---:|---:|---:|",
    ]
    totals = {v: {"extracted": 0, "kept": 0, "pages": 0} for v in result}
    for f in files:
        cells = []
        for variant in ("before", "after"):
            page = result[variant][str(f)]
            totals[variant]["extracted"] += page["extracted"]
            totals[variant]["kept"] += page["kept"]
            totals[variant]["pages"] += page["removed"] is None
            kept = f"{page['kept']:,}" if page["removed"] is None else f"0 (`{page['removed']}`)"
            cells += [f"{page['extracted']:,}", kept]
        rows.append(f"| {f.relative_to(root)} | " + " | ".join(cells) + " |")
    b, a = totals["before"], totals["after"]
    rows.append(
        f"| **total ({len(files)} pages)** | **{b['extracted']:,}** | **{b['kept']:,}** ({b['pages']} pages) "
        f"| **{a['extracted']:,}** | **{a['kept']:,}** ({a['pages']} pages) |"
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", nargs="+", help="HTML files or globs (quote globs: the script expands them)")
    ap.add_argument("--excerpt", help="the page whose kept text is shown (default: most extracted text)")
    ap.add_argument("--chars", type=int, default=400, help="characters of the excerpt (default 400)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("trafilatura").setLevel(logging.ERROR)  # "discarding data" for pages it skips
    files = pages(args.html)
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(files, Path(tmp))
    print(table(files, result))
    chosen = (
        str(Path(args.excerpt).resolve())
        if args.excerpt
        else max(result["after"], key=lambda f: result["after"][f]["extracted"])
    )
    for variant in ("before", "after"):
        page = result[variant][chosen]
        shown = page["text"][: args.chars] if page["removed"] is None else f"(removed: {page['removed']})"
        print(f"\n{variant}: {chosen} ({page['kept']:,} characters kept)\n{shown}")
    figures = {
        v: {f: {k: x for k, x in p.items() if k != "text"} for f, p in r.items()} for v, r in result.items()
    }
    print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
