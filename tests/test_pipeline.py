"""``lmforge data``: config, readers, passes, executors, accounting, resume, bad input, training on OUT."""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import zstandard

from lmforge.cli import main
from lmforge.corpus import readers
from lmforge.corpus.config import build_pipeline_config, load_pipeline_config, reference_markdown
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.pipeline import iter_kept, run_pipeline
from lmforge.corpus.stages import registry
from lmforge.corpus.stages.base import DocStage, run_corpus_stage
from lmforge.corpus.stages.dedup_exact import ExactDedup
from lmforge.corpus.stages.length import LengthFilter, LengthParams
from lmforge.data.tokenize_output import tokenize_output
from lmforge.errors import ConfigError, DataError, UserError
from lmforge.recipe import load_config

ROOT = Path(__file__).parents[1]
WORDS = [
    *("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from"),
    *("his", "her", "it", "an", "be", "this", "are", "or", "which", "river", "stone", "light", "garden"),
    *("window", "music", "market", "winter", "letter", "bridge", "forest", "silver", "paper", "morning"),
]


def _text(rng: random.Random, lo: int = 5, hi: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _write_corpus(root: Path, files: int = 3, docs: int = 200, seed: int = 0) -> None:
    """JSONL files of random-word documents, about one in eight a copy (up to case and spacing)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    earlier: list[str] = []
    for f in range(files):
        with (root / f"part-{f}.jsonl").open("w") as fh:
            for i in range(docs):
                if earlier and rng.random() < 0.125:
                    text = rng.choice(earlier).upper().replace(" ", "  ")
                else:
                    text = _text(rng)
                    earlier.append(text)
                rec = {"id": f"p{f}-{i}", "text": text} if i % 5 else {"text": text}  # some without id
                fh.write(json.dumps(rec) + "\n")


def _cfg(tmp_path: Path, sources: list[dict], stages: list[dict], **sections) -> object:
    tree = {"sources": sources, "stages": stages, "execution": {"chunk_bytes": 16384}, **sections}
    tree.setdefault("tokenize", {"vocab_size": 300, "val_fraction": 0.1})
    return build_pipeline_config(tree)


def _records(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("*.jsonl*")):
        out.extend(readers.json_records(path))
    return out


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (but the work folder's intermediate state) by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != "work"
    }


# ---------------------------------------------------------------------------------------------------------
# stages


def test_length_rules():
    stage = LengthFilter(LengthParams(min_chars=5, max_chars=40, min_words=2, max_words=5))
    doc = lambda t: Doc("d", t, "web")  # noqa: E731
    assert stage.process(doc("abc")) == Drop("length.too_few_chars", value=3, threshold=5)
    assert stage.process(doc("x" * 41)) == Drop("length.too_many_chars", value=41, threshold=40)
    assert stage.process(doc("oneword")) == Drop("length.too_few_words", value=1, threshold=2)
    assert stage.process(doc("a b c d e f")) == Drop("length.too_many_words", value=6, threshold=5)
    assert isinstance(stage.process(doc("two  words\n")), Doc)
    assert LengthFilter().params.min_words == 50  # Gopher's bound by default
    with pytest.raises(ValueError, match="min_words"):
        LengthParams(min_words=10, max_words=5)


def test_dedup_exact_reference_keeps_first_and_normalises(tmp_path):
    texts = ["Hello  World", "other text", "hello world", "ＨＥＬＬＯ World\n", "other text", "third"]
    docs = [Doc(f"d{i}", t, "web", (0, 0, i + 1)) for i, t in enumerate(texts)]
    outcomes, figures = run_corpus_stage(ExactDedup(), docs, tmp_path)
    kept = [o.id for o in outcomes if isinstance(o, Doc)]
    dups = {d.id: drop.duplicate_of for d, drop in (o for o in outcomes if isinstance(o, tuple))}
    assert kept == ["d0", "d1", "d5"]
    assert dups == {"d2": "d0", "d3": "d0", "d4": "d1"}  # full-width letters fold under NFKC
    assert figures == {"documents": 6, "unique": 3, "duplicates": 3}


# ---------------------------------------------------------------------------------------------------------
# config


def test_config_errors_are_one_line_exit_2(tmp_path, capsys):
    logger = logging.getLogger("lmforge")
    handlers, level = logger.handlers[:], logger.level
    try:
        _config_errors(tmp_path, capsys)
    finally:  # the CLI points lmforge's logger at the captured stderr; give it back
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _config_errors(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    cases = {
        'name = "lenght"': "stages[0].name: unknown stage 'lenght'; did you mean length?",
        'name = "length"\nmax_char = 3': "stages[0].max_char: unknown parameter of stage length; did you mean max_chars?",
        'name = "length"\nmin_words = "many"': "stages[0].min_words: length: Input should be a valid integer",
    }
    for body, message in cases.items():
        recipe = tmp_path / "r.toml"
        recipe.write_text(f'[[sources]]\npath = "{tmp_path / "in.jsonl"}"\n[[stages]]\n{body}\n')
        with pytest.raises(SystemExit) as exit_:
            main(["data", "--config", str(recipe), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ConfigError, match=r"execution\.worker: unknown key; did you mean execution\.workers"):
        build_pipeline_config({"sources": [{"path": "x"}], "execution": {"worker": 2}})
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs" / "data").glob("*.toml")), ids=lambda p: p.name)
def test_recipes_validate(recipe):
    cfg = load_pipeline_config(recipe)
    assert cfg.stages and cfg.sources


def test_docs_reference_is_current():
    docs = (ROOT / "docs" / "data-config.md").read_text()
    want = reference_markdown()
    assert set(registry.available()) == set(registry.STAGES)
    assert docs == want, "regenerate docs/data-config.md (command at its top)"


# ---------------------------------------------------------------------------------------------------------
# readers and bad input


def test_html_and_pdf_readers(tmp_path):
    from pypdf import PdfWriter

    html = "<html><head><title>T</title></head><body><p>Ünïcode body</p></body></html>"
    (tmp_path / "page.html").write_text(html)
    (tmp_path / "old.htm").write_bytes(b'<meta charset="iso-8859-1"><p>caf\xe9</p>')
    writer = PdfWriter()
    writer.add_blank_page(72, 72)
    with (tmp_path / "doc.pdf").open("wb") as fh:
        writer.write(fh)
    (tmp_path / "fake.pdf").write_text("not a pdf at all")
    opts = readers.ReadOptions(domain="web")
    got = {}
    for i, name in enumerate(["page.html", "old.htm", "doc.pdf", "fake.pdf"]):
        path = tmp_path / name
        (out,) = readers.read_piece(readers.Piece(0, i, str(path), readers.detect_format(path)), opts)
        got[name] = out
    assert got["page.html"].text == html and got["page.html"].meta == {"format": "html"}
    assert got["old.htm"].text == '<meta charset="iso-8859-1"><p>café</p>'
    pdf = got["doc.pdf"]
    assert pdf.text == "" and pdf.meta["format"] == "pdf"
    assert pdf.meta["raw"] == (tmp_path / "doc.pdf").read_bytes()
    assert got["fake.pdf"][1] == Drop("read.not_pdf")


def test_jsonl_html_content_is_marked_for_extract(tmp_path):
    rows = [{"u": "a", "body": "<p>x</p>", "kind": "html"}, {"u": "b", "body": "plain", "kind": "text"}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    piece = readers.Piece(0, 0, str(tmp_path / "r.jsonl"), "jsonl")
    by_field = readers.ReadOptions(text_field="body", id_field="u", format_field="kind")
    assert [(d.id, d.meta) for d in readers.read_piece(piece, by_field)] == [
        ("a", {"format": "html"}),
        ("b", {}),
    ]
    whole = readers.ReadOptions(text_field="body", id_field="u", content_format="html")
    assert [d.meta for d in readers.read_piece(piece, whole)] == [{"format": "html"}] * 2


def test_out_belongs_to_one_configuration_and_input(tmp_path):
    _write_corpus(tmp_path / "in", files=1, docs=20)
    sources = [{"path": str(tmp_path / "in")}]
    cfg = _cfg(tmp_path, sources, [{"name": "length", "min_words": 10}])
    first = run_pipeline(cfg, tmp_path / "out", workers=1)
    assert run_pipeline(cfg, tmp_path / "out", workers=1) == first  # a finished run is not redone
    other = _cfg(tmp_path, sources, [{"name": "length", "min_words": 11}])
    with pytest.raises(UserError, match="different pipeline configuration"):
        run_pipeline(other, tmp_path / "out", workers=1)
    with (tmp_path / "in" / "part-0.jsonl").open("a") as fh:
        fh.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(DataError, match="input changed since the run"):
        run_pipeline(cfg, tmp_path / "out", workers=1)
    with pytest.raises(UserError, match="not an lmforge data folder"):
        run_pipeline(cfg, tmp_path / "in", workers=1)


def test_bad_input_is_counted_reported_and_accounted(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    good = [json.dumps({"text": f"document number {i} " + _text(random.Random(i))}) for i in range(300)]
    lines = [*good[:3], "{not json", json.dumps({"text": ""}), json.dumps({"body": "no text"})]
    (src / "a.jsonl").write_bytes(
        "\n".join(lines).encode() + b"\n" + b'{"text": "caf\xe9"}\n' + good[3].encode()
    )
    gz = gzip.compress(("\n".join(good) + "\n").encode())
    (src / "b.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    zst = zstandard.ZstdCompressor().compress(("\n".join(good) + "\n").encode() * 4)
    (src / "c.jsonl.zst").write_bytes(zst[: len(zst) * 3 // 4])
    (src / "d.txt").write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4096)) + b"\0")
    (src / "e.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(range(256)))
    (src / "f.txt").write_text("   \n")
    cfg = _cfg(tmp_path, [{"path": str(src), "domain": "web"}], [{"name": "length", "min_words": 1}])
    report = run_pipeline(cfg, tmp_path / "out", workers=1)

    expected = {
        "read.malformed_json": (src / "a.jsonl", 4),
        "read.empty": (src / "a.jsonl", 5),
        "read.missing_text": (src / "a.jsonl", 6),
        "read.invalid_utf8": (src / "a.jsonl", 7),
        "read.binary": (src / "d.txt", 0),
    }
    removed = _records(tmp_path / "out" / "removed")
    by_reason = {}
    for rec in removed:
        by_reason.setdefault(rec["reason"], []).append(rec)
    for reason, (path, line) in expected.items():
        assert [(r["file"], r["line"]) for r in by_reason[reason] if r["file"] == str(path)] == [
            (str(path), line)
        ]
        assert {"file": str(path), "line": line, "reason": reason} in report["bad_input"]["listed"]
    assert {r["file"] for r in by_reason["read.truncated"]} == {
        str(src / "b.jsonl.gz"),
        str(src / "c.jsonl.zst"),
    }
    assert {r["file"] for r in by_reason["read.binary"]} == {str(src / "d.txt"), str(src / "e.jsonl")}
    assert [r["file"] for r in by_reason["read.empty"]] == [str(src / "a.jsonl"), str(src / "f.txt")]
    truncated_line = next(r["line"] for r in by_reason["read.truncated"] if r["file"].endswith(".gz"))
    assert 1 < truncated_line < 300  # records before the damage were read
    kept = _records(tmp_path / "out" / "kept")
    assert len(kept) == 4 + (truncated_line - 1) + sum(
        r["id"].startswith(str(src / "c.jsonl.zst")) for r in kept
    )
    # accounting: every input record is kept or removed, and the report agrees with the files
    (source,) = report["sources"]
    assert source["input"] == source["kept"] + source["removed"] == len(kept) + len(removed)
    assert report["bad_input"]["count"] == sum(len(v) for k, v in by_reason.items() if k.startswith("read."))


def test_large_file_cut_into_chunks_reads_the_same(tmp_path):
    _write_corpus(tmp_path / "in", files=1, docs=600)
    stages = [{"name": "length", "min_words": 10}]
    sources = [{"path": str(tmp_path / "in"), "domain": "web"}]
    one = _cfg(tmp_path, sources, stages, execution={"chunk_bytes": 2**30}, output={"compression": "none"})
    cut = _cfg(tmp_path, sources, stages, execution={"chunk_bytes": 8192}, output={"compression": "none"})
    r1 = run_pipeline(one, tmp_path / "one", workers=1)
    r2 = run_pipeline(cut, tmp_path / "cut", workers=1)
    assert r1["shards"] == 1 and r2["shards"] > 8
    assert _records(tmp_path / "one" / "kept") == _records(tmp_path / "cut" / "kept")
    assert _records(tmp_path / "one" / "removed") == _records(tmp_path / "cut" / "removed")
    ids = [r["id"] for r in _records(tmp_path / "cut" / "kept") + _records(tmp_path / "cut" / "removed")]
    assert f"{tmp_path / 'in' / 'part-0.jsonl'}:6" in ids  # id-less records are named path:line


# ---------------------------------------------------------------------------------------------------------
# the pipeline


class _CountVowels(DocStage):
    """A real stage for the test: counts vowels into meta, fails on one document, drops another."""

    name: ClassVar[str] = "count_vowels"

    def process(self, doc: Doc) -> Doc | Drop:
        if "explode" in doc.text:
            raise RuntimeError("a stage bug")
        if doc.text.startswith("drop"):
            return self.drop("asked")
        doc.meta["counts"] = {"vowels": sum(doc.text.count(v) for v in "aeiou")}
        return doc


def test_domains_meta_counters_errors_and_dedup_against_reference(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.STAGES, "count_vowels", "tests.test_pipeline:_CountVowels")
    web = tmp_path / "web.jsonl"
    code = tmp_path / "code.jsonl"
    web_texts = ["Same text here", "same text  here", "explode now", "drop me", "unique web page", "aaa e"]
    code_texts = ["x = 1", "x = 1", "drop this code"]
    web.write_text("".join(json.dumps({"id": f"w{i}", "text": t}) + "\n" for i, t in enumerate(web_texts)))
    code.write_text("".join(json.dumps({"id": f"c{i}", "text": t}) + "\n" for i, t in enumerate(code_texts)))
    cfg = _cfg(
        tmp_path,
        [{"path": str(web), "domain": "web"}, {"path": str(code), "domain": "code"}],
        [{"name": "count_vowels", "domains": ["web"]}, {"name": "dedup_exact", "domains": ["web"]}],
        execution={"chunk_bytes": 16384, "max_error_fraction": 0.2},  # 1 error in 6 web documents
    )
    report = run_pipeline(cfg, tmp_path / "out", workers=1)
    kept = {r["id"]: r for r in _records(tmp_path / "out" / "kept")}
    removed = {r["id"]: r for r in _records(tmp_path / "out" / "removed")}
    assert set(kept) == {"w0", "w4", "w5", "c0", "c1", "c2"}  # code: no vowel stage, no dedup
    assert removed["w1"] == {
        "id": "w1",
        "domain": "web",
        "source": 0,
        "reason": "dedup_exact.duplicate",
        "duplicate_of": "w0",
        "value": None,
        "threshold": None,
    }
    assert removed["w2"]["reason"] == "count_vowels.error" and removed["w3"]["reason"] == "count_vowels.asked"
    vowels = next(s for s in report["stages"] if s["stage"] == "count_vowels")
    assert vowels["errors"]["count"] == 1 and vowels["errors"]["documents"] == 6  # web documents only
    assert kept["w5"]["meta"] == {"counts": {"vowels": 4}} and kept["c0"]["meta"] == {}
    assert report["meta"] == {"counts.vowels": 5 + 7 + 4}  # summed over kept documents
    dedup = next(s for s in report["stages"] if s["stage"] == "dedup_exact")
    assert dedup["plan"] == {"documents": 4, "unique": 3, "duplicates": 1} and dedup["domains"] == ["web"]
    assert [s["input"] - s["kept"] - s["removed"] for s in report["sources"]] == [0, 0]
    # the executor's parallel phases agree with the contract's sequential reference driver
    docs = [Doc(f"w{i}", t, "web", (0, 0, i + 1)) for i, t in enumerate(web_texts) if i in (0, 1, 4, 5)]
    outcomes, _ = run_corpus_stage(ExactDedup(), docs, tmp_path / "ref")
    assert [o.id for o in outcomes if isinstance(o, Doc)] == ["w0", "w4", "w5"]


def test_removed_records_carry_value_threshold_and_optionally_text(tmp_path):
    """Every removal names its rule, what the rule measured and the bound; ``output.removed_text``
    adds the text as the removing stage saw it (here: after normalize), and changes nothing else."""
    texts = {"a": "one two three four", "b": "too short\r\n\r\n", "c": "One  two three four", "d": "x" * 50}
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in texts.items()))
    stages = [
        {"name": "normalize"},
        {"name": "length", "min_words": 3, "max_chars": 40},
        {"name": "dedup_exact"},
    ]
    run_pipeline(_cfg(tmp_path, [{"path": str(src)}], stages), tmp_path / "plain", workers=1)
    with_text = _cfg(tmp_path, [{"path": str(src)}], stages, output={"removed_text": True})
    run_pipeline(with_text, tmp_path / "text", workers=1)
    plain = {r["id"]: r for r in _records(tmp_path / "plain" / "removed")}
    text = {r["id"]: r for r in _records(tmp_path / "text" / "removed")}
    base = {"domain": "default", "source": 0}
    assert plain == {
        "b": {"id": "b", **base, "reason": "length.too_few_words", "value": 2, "threshold": 3},
        "c": {
            "id": "c",
            **base,
            "reason": "dedup_exact.duplicate",
            "duplicate_of": "a",
            "value": None,
            "threshold": None,
        },
        "d": {"id": "d", **base, "reason": "length.too_many_chars", "value": 50, "threshold": 40},
    }
    assert text == {
        "b": plain["b"] | {"text": "too short"},  # normalised: the text the length stage measured
        "c": plain["c"] | {"text": "One  two three four"},
        "d": plain["d"] | {"text": "x" * 50},
    }
    assert _records(tmp_path / "plain" / "kept") == _records(tmp_path / "text" / "kept")


def test_local_processes_equal_inline_and_report_is_consistent(tmp_path):
    _write_corpus(tmp_path / "in", files=3, docs=150)
    cfg = _cfg(
        tmp_path,
        [
            {"path": str(tmp_path / "in" / "part-[01].jsonl"), "domain": "a"},
            {"path": str(tmp_path / "in" / "part-2.jsonl"), "domain": "b"},
        ],
        [{"name": "length", "min_words": 20}, {"name": "dedup_exact"}, {"name": "length", "max_words": 100}],
    )
    inline = run_pipeline(cfg, tmp_path / "inline", workers=1)
    procs = run_pipeline(cfg, tmp_path / "procs", workers=2)
    assert _tree(tmp_path / "inline") == _tree(tmp_path / "procs") and inline == procs
    rows = {s["stage"]: s for s in inline["stages"]}
    assert list(rows) == ["read", "length", "dedup_exact", "length#2"]
    chain = list(rows.values())
    for a, b in itertools.pairwise(chain):
        assert a["docs_out"] == b["docs_in"] and a["bytes_out"] == b["bytes_in"]
    for row in chain:
        assert row["docs_in"] - row["docs_out"] == sum(row["removed"].values())
    assert rows["dedup_exact"]["removed"]["dedup_exact.duplicate"] > 20
    for src in inline["sources"]:
        assert src["input"] == src["kept"] + src["removed"] and src["input"] > 0
    assert inline["documents"]["input"] == 450 and inline["kept_by_domain"].keys() == {"a", "b"}
    removed = _records(tmp_path / "inline" / "removed")
    dups = [r for r in removed if r["reason"] == "dedup_exact.duplicate"]
    kept_ids = {r["id"] for r in _records(tmp_path / "inline" / "kept")}
    assert dups and all(r["duplicate_of"] not in {d["id"] for d in dups} for r in dups)
    assert {r["duplicate_of"] for r in dups} - kept_ids <= {r["id"] for r in removed}  # first may fall later


def test_resume_after_sigkill_gives_the_same_output(tmp_path):
    _write_corpus(tmp_path / "in", files=4, docs=1500, seed=1)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[[sources]]\npath = "{tmp_path / "in"}"\ndomain = "web"\n'
        '[[stages]]\nname = "length"\nmin_words = 10\n[[stages]]\nname = "dedup_exact"\n'
        "[execution]\nchunk_bytes = 12000\n[tokenize]\nvocab_size = 300\n"
    )
    cfg = load_pipeline_config(recipe)
    run_pipeline(cfg, tmp_path / "straight", workers=1)  # uninterrupted, in this process
    tokenize_output(cfg, tmp_path / "straight")
    ref = json.loads((tmp_path / "straight" / "report.json").read_text())

    out = tmp_path / "resumed"
    cmd = [
        sys.executable,
        "-m",
        "lmforge",
        "data",
        "--config",
        str(recipe),
        "--out",
        str(out),
        "--workers",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list((out / "work" / "pass-0").glob("*.done"))) < 3 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers, as a crash would
    proc.wait()
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "work" / "pass-0").glob("*.done")}
    assert 3 <= len(done_before) < ref["shards"] and not (out / "report.json").exists()

    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "continuing the run" in r.stderr
    for name, mtime in done_before.items():  # finished shards were not redone
        assert (out / "work" / "pass-0" / name).stat().st_mtime_ns == mtime
    straight, resumed = _tree(tmp_path / "straight"), _tree(out)
    report = json.loads(resumed.pop("report.json"))
    ref.pop("tokens", None)
    report.pop("tokens")
    straight.pop("report.json")
    assert report == ref
    assert straight.keys() == resumed.keys() and straight == resumed  # kept/, removed/, tokens/ byte for byte


def test_ray_executor_equals_local(tmp_path):
    ray = pytest.importorskip("ray")
    _write_corpus(tmp_path / "in", files=2, docs=120)
    cfg = _cfg(
        tmp_path,
        [{"path": str(tmp_path / "in"), "domain": "web"}],
        [{"name": "length", "min_words": 15}, {"name": "dedup_exact"}],
    )
    local = run_pipeline(cfg, tmp_path / "local", workers=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_pipeline(cfg, tmp_path / "ray", executor="ray", workers=2)
    finally:
        ray.shutdown()
    assert on_ray == local and _tree(tmp_path / "ray") == _tree(tmp_path / "local")
    assert local["shards"] > 2


def test_output_trains_with_domains(tmp_path):
    from lmforge.train.launch import train
    from tests.conftest import tiny_overrides

    _write_corpus(tmp_path / "web", files=1, docs=150)
    _write_corpus(tmp_path / "code", files=1, docs=100, seed=3)
    cfg = _cfg(
        tmp_path,
        [
            {"path": str(tmp_path / "web"), "domain": "web"},
            {"path": str(tmp_path / "code"), "domain": "code"},
        ],
        [{"name": "dedup_exact"}],
    )
    out = tmp_path / "out"
    run_pipeline(cfg, out, workers=1)
    tokens = tokenize_output(cfg, out)
    assert set(tokens["documents"]) == {"web.train", "web.val", "code.train", "code.val"}
    assert sum(tokens["documents"].values()) == sum(1 for _ in iter_kept(out))
    again = tokenize_output(cfg, out)  # current shards are reused
    assert again == tokens
    over = tiny_overrides(tmp_path, tmp_path / "unused")
    over.pop("data.sources")
    over.update(
        {
            "data.prepared": str(out),
            "train.steps": 4,
            "train.eval_interval": 0,
            "train.checkpoint_interval": 0,
        }
    )
    summary = train(load_config(None, over), tmp_path / "run", progress_bar=False)
    assert summary["step"] == 4 and summary["val_loss"] < 7
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == (
        out / "tokens" / "tokenizer.json"
    ).read_bytes()
