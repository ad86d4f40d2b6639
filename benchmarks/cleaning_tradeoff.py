"""The model-based stages and the cleaning trade-off on real text that lmforge did not write.

The **web-like sample** (``OUT/sample/web.jsonl``) mixes four kinds of text found on a Debian machine
with a Python environment, all written by other people:

* ``html``: HTML documentation pages shipped with Debian packages (``/usr/share/doc/**/*.html``), raw;
* ``pypi``: the long descriptions (READMEs) of the installed Python distributions, as published on PyPI
  (their ``METADATA`` files);
* ``changelog``: Debian package changelogs (``/usr/share/doc/*/changelog.Debian.gz``);
* ``copyright``: Debian copyright files (licence texts, many repeated across packages).

Each record is cut to its first 30,000 characters. Changelogs and copyright files are split by a hash
of their package name: one half goes into the sample, the other half is the quality classifier's
*negative* examples; its *positive* examples are the prose of the Python standard library (module
docstrings and the language reference topics, ``builtin:pystdlib`` prose). So the classifier never
scores a document it was trained on.

Steps: build the sample; ``lmforge data train-classifier``; the reference run (``--reference-run``, or
``lmforge train`` on the built-in corpus for ``--ref-steps`` steps); ``lmforge data`` with
``configs/data/web-model.toml`` pointed at the sample, then the kept and removed documents per stage and
origin; ``lmforge data sweep`` on the sample (quality: the classifier) and on the built-in corpus
(``configs/data/pystdlib.toml``, quality: perplexity under the reference run).

    python benchmarks/cleaning_tradeoff.py --out /tmp/tradeoff [--reference-run RUN] [--levels 0,20,...]

The last line printed is one JSON object; ``OUT/summary.json`` holds it too.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAX_CHARS = 30_000
LMFORGE = [sys.executable, "-m", "lmforge"]


def _half(name: str) -> int:
    """0 or 1 by a hash of ``name``: the half of a package's files (sample or classifier training)."""
    return hashlib.sha256(name.encode()).digest()[0] & 1


def _record(origin: str, name: str, text: str, fmt: str = "text") -> dict[str, Any]:
    return {"id": f"{origin}:{name}", "text": text[:MAX_CHARS], "format": fmt, "origin": origin}


def pypi_descriptions() -> list[dict[str, Any]]:
    """The long description of every installed distribution that has one of 200+ characters."""
    out, seen = [], set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        body = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        body = body or dist.metadata.get("Description") or ""
        if name and name not in seen and len(body.strip()) >= 200:
            seen.add(name)
            out.append(_record("pypi", name, body))
    return sorted(out, key=lambda r: r["id"])


def debian_texts(kind: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(sample half, training half)`` of Debian ``changelog`` or ``copyright`` files."""
    pattern = "/usr/share/doc/*/changelog.Debian.gz" if kind == "changelog" else "/usr/share/doc/*/copyright"
    halves: tuple[list, list] = ([], [])
    for path in sorted(glob.glob(pattern)):
        pkg = Path(path).parent.name
        try:
            raw = (
                gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else Path(path).read_bytes()
            )
        except OSError:
            continue
        text = raw.decode("utf-8", "replace")
        if text.strip():
            halves[_half(pkg)].append(_record(kind, pkg, text))
    return halves


def html_pages() -> list[dict[str, Any]]:
    pages = sorted(p for p in set(glob.glob("/usr/share/doc/**/*.html", recursive=True)) if Path(p).is_file())
    out = []
    for path in pages:
        text = Path(path).read_bytes().decode("utf-8", "replace")
        out.append(_record("html", path.removeprefix("/usr/share/doc/"), text, "html"))
    return out


def build_sample(out: Path) -> dict[str, Any]:
    """Write ``sample/web.jsonl`` and the classifier's ``positive.jsonl`` / ``negative.jsonl``."""
    from lmforge.corpus.pystdlib import read_pystdlib

    out.mkdir(parents=True, exist_ok=True)
    changelog_sample, changelog_train = debian_texts("changelog")
    copyright_sample, copyright_train = debian_texts("copyright")
    sample = html_pages() + pypi_descriptions() + changelog_sample + copyright_sample
    positive = [
        {"id": d.id, "text": d.text[:MAX_CHARS]}
        for d in read_pystdlib()
        if d.domain == "prose" and d.text.strip()
    ]
    negative = changelog_train + copyright_train
    for name, rows in (("web.jsonl", sample), ("positive.jsonl", positive), ("negative.jsonl", negative)):
        with (out / name).open("w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    return {
        "sample": dict(Counter(r["origin"] for r in sample)),
        "classifier_positive": len(positive),
        "classifier_negative": dict(Counter(r["origin"] for r in negative)),
    }


def run(cmd: list[str], log: Path) -> float:
    """Run an lmforge command, its output into ``log``; returns seconds; stops the script if it fails."""
    start = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}); see {log}")
    return time.perf_counter() - start


def web_recipe(out: Path, sample: Path, model: Path, reference: Path) -> Path:
    """``configs/data/web-model.toml`` with its sources replaced by the sample and its model paths set."""
    import tomllib

    from lmforge.recipe import dump_toml

    tree = tomllib.loads((ROOT / "configs" / "data" / "web-model.toml").read_text())
    tree["sources"] = [{"path": str(sample), "format_field": "format", "domain": "web"}]
    for stage in tree["stages"]:
        if stage["name"] == "classifier":
            stage["model"] = str(model)
        if stage["name"] == "perplexity":
            stage["run"] = str(reference)
    tree["tokenize"] = {"enabled": False}
    path = out / "web-model.toml"
    path.write_text(dump_toml(tree))
    return path


def stage_by_origin(data_out: Path) -> dict[str, dict[str, int]]:
    """Per origin: documents kept and removed per stage (from ``kept/`` and ``removed/``)."""
    from lmforge.corpus.pipeline import iter_kept
    from lmforge.corpus.removals import iter_removed

    table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for doc in iter_kept(data_out):
        table[doc.id.split(":", 1)[0]]["kept"] += 1
    for rec in iter_removed(data_out):
        table[str(rec["id"]).split(":", 1)[0]][rec["reason"].split(".")[0]] += 1
    return {k: dict(v) for k, v in sorted(table.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--reference-run", type=Path, help="a trained run (default: train one)")
    ap.add_argument("--ref-steps", type=int, default=300, help="steps of the reference run trained here")
    ap.add_argument("--levels", default="0,20,40,60,80,100")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    counts = out / "sample" / "counts.json"
    if not counts.exists():  # built once: a rebuilt sample is a changed input to the runs already there
        counts.parent.mkdir(parents=True, exist_ok=True)
        counts.write_text(json.dumps(build_sample(out / "sample")))
    summary: dict[str, Any] = {"sources": json.loads(counts.read_text())}

    model = out / "quality.npz"
    if not model.exists():
        summary["train_classifier_s"] = run(
            [
                *LMFORGE,
                "data",
                "train-classifier",
                "--positive",
                str(out / "sample" / "positive.jsonl"),
                "--negative",
                str(out / "sample" / "negative.jsonl"),
                "--out",
                str(model),
            ],
            out / "train-classifier.log",
        )
    report = next(out.glob("quality*.json"), None)
    summary["classifier"] = json.loads(report.read_text()) if report else None

    reference = args.reference_run.resolve() if args.reference_run else out / "reference"
    if not args.reference_run and not (reference / "summary.json").exists():
        summary["reference_train_s"] = run(
            [
                *LMFORGE,
                "train",
                "--run-dir",
                str(reference),
                f"--train.steps={args.ref_steps}",
                f"--train.eval_interval={args.ref_steps}",
                f"--train.checkpoint_interval={args.ref_steps}",
            ],
            out / "reference.log",
        )
    summary["reference_run"] = str(reference)

    recipe = web_recipe(out, out / "sample" / "web.jsonl", model, reference)
    data_out = out / "web-model"
    summary["data_s"] = run(
        [*LMFORGE, "data", "--config", str(recipe), "--out", str(data_out), "--workers", str(args.workers)],
        out / "data.log",
    )
    rep = json.loads((data_out / "report.json").read_text())
    summary["stages"] = [
        {"stage": s["stage"], "docs_in": s["docs_in"], "docs_out": s["docs_out"], "removed": s["removed"]}
        for s in rep["stages"]
    ]
    summary["by_origin"] = stage_by_origin(data_out)

    for name, cfg, flags in (
        ("sweep-web", recipe, []),
        ("sweep-pystdlib", ROOT / "configs" / "data" / "pystdlib.toml", ["--reference-run", str(reference)]),
    ):
        summary[f"{name}_s"] = run(
            [
                *LMFORGE,
                "data",
                "sweep",
                "--config",
                str(cfg),
                "--out",
                str(out / name),
                "--levels",
                args.levels,
                "--workers",
                str(args.workers),
                *flags,
            ],
            out / f"{name}.log",
        )
        summary[name] = json.loads((out / name / "sweep.json").read_text())["rows"]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for row in summary["stages"]:
        print(f"{row['stage']:<20} {row['docs_in']:>6} -> {row['docs_out']:>6}  {row['removed']}")
    for origin, counts in summary["by_origin"].items():
        print(f"{origin:<10} {counts}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
