"""``lmforge data inspect``: samples of what a rule removed, through the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.pipeline import run_pipeline
from lmforge.corpus.removals import excerpt

LONG = " ".join(f"word{i}" for i in range(400))  # 3,089 characters: over max_chars


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Every test here runs the CLI."""


def _run(tmp_path: Path, name: str, removed_text: bool) -> Path:
    """A finished run: 7 documents too short, 2 too long, 1 duplicate, 3 kept."""
    src = tmp_path / "in.jsonl"
    if not src.exists():
        docs = {f"short{i}": f"only {i}" for i in range(7)}
        docs |= {"long0": LONG, "long1": LONG + " more", "ok0": "one two three", "ok1": "four five six seven"}
        docs |= {"copy": "ONE two  three", "ok2": "eight nine ten"}
        src.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    cfg = build_pipeline_config(
        {
            "sources": [{"path": str(src)}],
            "stages": [{"name": "length", "min_words": 3, "max_chars": 1000}, {"name": "dedup_exact"}],
            "output": {"removed_text": removed_text},
        }
    )
    out = tmp_path / name
    run_pipeline(cfg, out, workers=1)
    return out


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["data", "inspect", *args])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_inspect_counts_and_shows_the_first_removals_with_their_measure(tmp_path, capsys):
    out = _run(tmp_path, "out", removed_text=True)
    code, text, _ = _inspect(capsys, str(out), "--reason", "length", "--n", "2")
    assert code == 0
    head, *samples = text.split("\n\n")
    assert head == (
        f"length: 9 documents removed in {out} (length.too_few_words 7, length.too_many_chars 2); the first 2:"
    )
    assert len(samples) == 2
    assert samples[0].splitlines() == [
        f"[1] short0  (source 0: {tmp_path / 'in.jsonl'}; domain default)",
        "    length.too_few_words: value 2, threshold 3",
        "    | only 0",
    ]
    assert samples[1].startswith("[2] short1 ")

    code, text, _ = _inspect(capsys, str(out), "--reason", "length.too_many_chars", "--chars", "100")
    assert code == 0 and text.startswith("length.too_many_chars: 2 documents removed") and "; all:" in text
    first = text.split("\n\n")[1].splitlines()
    assert first[1] == f"    length.too_many_chars: value {len(LONG):,}, threshold 1,000"
    shown = first[2].removeprefix("    | ")
    assert LONG.startswith(shown) and shown.endswith(" word14")  # 100 characters end inside "word15"
    assert first[3] == f"    | ... {len(LONG) - len(shown):,} more characters"

    code, text, _ = _inspect(capsys, str(out), "--reason", "dedup_exact.duplicate")
    assert code == 0 and "dedup_exact.duplicate: duplicate of ok0" in text and "| ONE two  three" in text


def test_inspect_without_removed_text_names_the_documents_and_how_to_keep_text(tmp_path, capsys):
    out = _run(tmp_path, "out", removed_text=False)
    code, text, _ = _inspect(capsys, str(out), "--reason", "dedup")
    assert code == 0
    assert text.splitlines()[:4] == [
        f"dedup: 1 documents removed in {out} (dedup_exact.duplicate 1); all:",
        "",
        f"[1] copy  (source 0: {tmp_path / 'in.jsonl'}; domain default)",
        "    dedup_exact.duplicate: duplicate of ok0",
    ]
    assert "|" not in text and "--output.removed_text=true" in text.splitlines()[-1]


def test_inspect_bad_input_is_one_line_exit_2(tmp_path, capsys):
    out = _run(tmp_path, "out", removed_text=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    unfinished = tmp_path / "unfinished"
    (unfinished / "work").mkdir(parents=True)
    (unfinished / "work" / "plan.json").write_text("{}")
    nowhere = tmp_path / "nowhere"
    cases = [
        (nowhere, "c4", f"OUT {nowhere}: does not exist; give the --out folder of a `lmforge data` run"),
        (empty, "c4", f"OUT {empty}: is not an lmforge data output folder (no work/plan.json)"),
        (unfinished, "c4", "has not finished (no report.json); run the same `lmforge data` command again"),
        (out, "c4", "--reason c4: no document in"),
        (
            out,
            "length.to_few_words",
            "did you mean length.too_few_words? rules present: "
            "dedup_exact.duplicate (1), length.too_few_words (7), length.too_many_chars (2)",
        ),
    ]
    for folder, rule, message in cases:
        code, text, err = _inspect(capsys, str(folder), "--reason", rule)
        assert code == 2 and text == "" and message in err, (rule, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("lmforge data inspect: error: ")
    for flag in ("--n", "--chars"):
        code, _, err = _inspect(capsys, str(out), "--reason", "length", flag, "0")
        assert code == 2 and err.startswith(f"lmforge data inspect: error: {flag}: give how many")


def test_data_command_still_takes_space_separated_overrides(tmp_path, capsys):
    """``inspect`` is routed before parsing, so ``--KEY VALUE`` overrides of ``lmforge data`` stay free."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "some words here"}) + "\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[[sources]]\npath = "{src}"\n[[stages]]\nname = "length"\nmin_words = 5\n')
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "data",
                "--config",
                str(recipe),
                "--out",
                str(out),
                "--no-tokenize",
                "--output.compression",
                "none",
            ]
        )
    assert exit_.value.code == 0 and (out / "removed" / "00000.jsonl").is_file()
    capsys.readouterr()
    code, text, _ = _inspect(capsys, str(out), "--reason", "length")
    assert code == 0 and "length.too_few_words: value 3, threshold 5" in text


def test_excerpt_cuts_at_a_space_and_counts_the_rest():
    assert excerpt("short text", 100, 5) == ("short text", 0)
    assert excerpt("alpha beta gamma", 13, 5) == ("alpha beta", 6)  # not "alpha beta ga"
    assert excerpt("a\nb\nc\nd", 100, 2) == ("a\nb", 4)
