"""``lmforge tokenizers compare``: the three kinds train and carry ``<|endoftext|>``; each metric is what
one counts by hand on the tokenizer's own output; bits per byte is the formula on known numbers and on a
trained model's held-out loss; bad flags stop with exit status 2 before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.corpus.document import Doc
from lmforge.corpus.pystdlib import stdlib_root
from lmforge.data.tokenizer_compare import (
    ALL,
    CompareSettings,
    bits_per_byte,
    bytes_per_token,
    check_settings,
    fertility,
    held_out,
    measure,
    vocab_share,
)
from lmforge.errors import UserError
from lmforge.tokenizer import EOT, Tokenizer
from lmforge.tokenizer.kinds import BYTE_PIECES, KINDS, WORDPIECE_UNK, train_kind

MODULES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py"]


# Tolerances: every pytest.approx here keeps its default (1e-6 relative). Both sides are float64 arithmetic on
# Python numbers (counts, logs, the figures a run reported), the same on every CPU: the default only absorbs
# the rounding of a formula written in another order (~1e-16 relative).


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Training text: a few standard-library modules (ASCII code and docstrings), cut into chunks."""
    out = []
    for name in MODULES:
        out += [c for c in (stdlib_root() / name).read_text(encoding="utf-8").split("\n\n") if c.strip()]
    return out


@pytest.fixture(scope="module")
def tokenizers(texts, tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("kinds")
    return {kind: train_kind(kind, texts, 400, root / f"{kind}.json") for kind in KINDS}


HAND = [
    Doc("a", "def add(a, b):\n    return a + b\n", "code"),
    Doc("b", "The quick  brown fox, said the snowman \u2603.", "prose"),
    Doc("c", "Split the string into words.\n", "prose"),
]


def test_formulas_on_known_numbers():
    assert fertility(15, 10) == 1.5
    assert bytes_per_token(100, 25) == 4.0
    assert vocab_share(64, 256) == 0.25
    # a model that spends exactly ln 2 nats per byte codes one bit per byte; uniform over 256 bytes: 8
    assert bits_per_byte(math.log(2) * 1000, 1000) == pytest.approx(1.0)
    # approx default rel 1e-6 on float64 formulas: see the Tolerances note at the top
    assert bits_per_byte(500 * math.log(256), 500) == pytest.approx(8.0)
    assert bits_per_byte(3.0 * 40, 100) == pytest.approx(3.0 * 40 / (math.log(2) * 100))


def test_every_kind_trains_and_carries_eot(tokenizers):
    for kind, tok in tokenizers.items():
        assert tok._tok.id_to_token(tok.eot_id) == EOT, kind
        assert tok.vocab_size <= 400, kind
        # the separator is one token wherever it appears, as training's packed sequences need
        ids = tok.encode(f"x = 1{EOT}y")
        assert ids.count(tok.eot_id) == 1, kind
    assert tokenizers["bpe"].vocab_size == 400


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_are_the_counts_of_the_tokenizers_output(tokenizers, kind):
    tok = tokenizers[kind]
    rows = measure(tok, kind, HAND)
    enc = {d.id: tok.encode(d.text) for d in HAND}
    prose = [d for d in HAND if d.domain == "prose"]
    tokens = sum(len(enc[d.id]) for d in prose)
    words = sum(len(d.text.split()) for d in prose)  # 8 + 5
    assert words == 13
    assert rows["prose"]["tokens"] == tokens
    # approx default rel 1e-6: float64 ratios of counts, see the Tolerances note at the top
    assert rows["prose"]["fertility"] == pytest.approx(tokens / words)
    assert rows["prose"]["bytes_per_token"] == pytest.approx(
        sum(len(d.text.encode()) for d in prose) / tokens
    )
    assert rows["code"]["fertility"] == pytest.approx(len(enc["a"]) / 7)  # def, add(a,, b):, return, a, +, b
    distinct = {i for ids in enc.values() for i in ids}
    # approx default rel 1e-6: float64 ratios of counts, see the Tolerances note at the top
    assert rows[ALL]["vocab_used"] == pytest.approx(len(distinct) / tok.vocab_size)
    round_trips = sum(tok.decode(enc[d.id]) == d.text for d in HAND)
    assert rows[ALL]["round_trip"] == pytest.approx(round_trips / 3)


def test_unknown_rates_bpe_none_unigram_bytes_wordpiece_unk(tokenizers):
    snow = HAND[1]  # the snowman is in no training text
    bpe = measure(tokenizers["bpe"], "bpe", [snow])[ALL]
    assert bpe["unknown_rate"] == 0.0 and bpe["round_trip"] == 1.0
    uni = tokenizers["unigram"]
    ids = uni.encode(snow.text)
    pieces = [uni._tok.id_to_token(i) for i in ids]
    assert [p for p in pieces if p in BYTE_PIECES] == ["<0xE2>", "<0x98>", "<0x83>"]  # UTF-8 of U+2603
    row = measure(uni, "unigram", [snow])[ALL]
    # approx default rel 1e-6: a float64 ratio of counts, see the Tolerances note at the top
    assert row["unknown_rate"] == pytest.approx(3 / len(ids))
    assert row["round_trip"] == 1.0  # byte fallback gives the snowman back
    wp = tokenizers["wordpiece"]
    ids = wp.encode(snow.text)
    assert ids.count(wp._tok.token_to_id(WORDPIECE_UNK)) == 1
    row = measure(wp, "wordpiece", [snow])[ALL]
    # approx default rel 1e-6: a float64 ratio of counts, see the Tolerances note at the top
    assert row["unknown_rate"] == pytest.approx(1 / len(ids))
    assert row["round_trip"] == 0.0  # normalised: the double space and the snowman are gone


def test_held_out_split_is_seeded():
    ids = [f"doc{i}" for i in range(400)]
    a = {i for i in ids if held_out(i, 0.1, 0)}
    b = {i for i in ids if held_out(i, 0.1, 1)}
    assert 20 < len(a) < 60 and a != b
    assert a == {i for i in ids if held_out(i, 0.1, 0)}


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--kinds", "bpe,sentencepiece"], "--kinds"),
        (["--vocab-sizes", "300", "--kinds", "unigram"], "--vocab-sizes"),
        (["--vocab-sizes", "100"], "too small for bpe"),
        (["--vocab-sizes", "4k"], "--vocab-sizes"),
        (["--sources", "missing/*.jsonl"], "--sources"),
        (["--sources", "builtin:nope"], "--sources"),
        (["--train-steps", "-1"], "--train-steps"),
    ],
)
def test_bad_flags_exit_2_before_any_work(tmp_path, capsys, flags, words):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main(["tokenizers", "compare", "--out", str(out), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
    assert not out.exists()


def test_out_file_and_no_documents_exit_2(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["tokenizers", "compare", "--out", str(tmp_path / "file")])
    assert exc.value.code == 2 and "--out" in capsys.readouterr().err
    blank = _jsonl(tmp_path / "blank.jsonl", ["  ", "\n"])
    with pytest.raises(SystemExit) as exc:
        main(["tokenizers", "compare", "--sources", str(blank), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "no document with text" in capsys.readouterr().err
    with pytest.raises(UserError, match="--max-docs"):
        check_settings(CompareSettings(max_docs=1, out=tmp_path / "o"))


def test_compare_end_to_end_with_two_training_steps(corpus_dir, tmp_path, capsys):
    """Two kinds trained, measured and a 2-step model trained on each (unigram is left to the test above, for
    time); JSON, PNG and table written; the bits per byte are the held-out loss turned by the formula; the
    runs differ only in the tokenizer."""
    out = tmp_path / "cmp"
    main_args = [
        "tokenizers",
        "compare",
        "--sources",
        f"code={corpus_dir / 'stdlib.jsonl'}",
        "--out",
        str(out),
    ]
    with pytest.raises(SystemExit) as exc:
        main(
            [
                *main_args,
                "--kinds",
                "bpe,wordpiece",
                "--vocab-sizes",
                "400",
                "--max-docs",
                "100",
                "--train-steps",
                "2",
            ]
        )
    assert exc.value.code == 0
    table = capsys.readouterr().out
    assert "bits per byte" in table and "wordpiece" in table
    result = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["kind"] for r in result["results"]] == ["bpe", "wordpiece"]
    assert result["domains"] == ["code", ALL]
    configs = []
    for r in result["results"]:
        run = out / "runs" / f"{r['kind']}-400"
        assert Tokenizer(run / "tokenizer.json").sha256 == Tokenizer(r["path"]).sha256
        m = r["model"]
        assert m["steps"] == 2
        row = m["domains"]["code"]
        # approx default rel 1e-6: the run's float64 figures recombined (see the Tolerances note at the top)
        assert row["bpb"] == pytest.approx(
            row["loss_per_token"] * row["targets"] / (math.log(2) * row["bytes"])
        )
        configs.append({k: v for k, v in m["config"].items() if k != "data.vocab_size"})
        assert r["domains"]["code"]["documents"] == result["documents"]["held_out"]
    assert configs[0] == configs[1]
    held = sum(1 for _ in (out / "work" / "held-out" / "code.jsonl").open())
    assert held == result["documents"]["held_out"] > 0
    # training's own split (data.val_fraction over the written ids) is the comparison's held-out split
    metas = [json.loads(p.read_text()) for p in (out / "work" / "cache").glob("*/meta.json")]
    assert len(metas) == 2
    for meta in metas:
        assert meta["documents"] == {"code.train": result["documents"]["train"], "code.val": held}
