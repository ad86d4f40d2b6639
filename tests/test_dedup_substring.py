"""Exact-substring deduplication: hand-made cases and a brute-force reference on random corpora."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages import dedup_substring
from lmforge.corpus.stages.base import run_corpus_stage
from lmforge.corpus.stages.dedup_substring import Params, SubstringDedup
from lmforge.errors import DataError


def noise(rng: random.Random, n: int) -> str:
    """``n`` characters of random lower-case words: no 100-byte span of it recurs by chance."""
    out = []
    while sum(map(len, out)) < n:
        out.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + " ")
    return "".join(out)[:n]


def run(docs: list[Doc], tmp_path: Path, **params) -> tuple[list[Doc | tuple[Doc, Drop]], dict]:
    return run_corpus_stage(SubstringDedup(Params(**params)), docs, tmp_path)


def test_planted_span_is_removed_from_all_but_the_first_occurrence(tmp_path: Path):
    rng = random.Random(0)
    span = noise(rng, 120)
    parts = [(noise(rng, 200), noise(rng, 150)) for _ in range(4)]
    docs = [Doc(f"d{i}", a + span + b, "t", (0, 0, i)) for i, (a, b) in enumerate(parts)]
    docs.append(Doc("clean", noise(rng, 400), "t", (0, 0, 9)))
    outcomes, figures = run(docs, tmp_path)
    assert all(isinstance(o, Doc) for o in outcomes)
    assert outcomes[0] is docs[0]  # the first occurrence (corpus order) stays, untouched
    assert outcomes[4] is docs[4]
    for (a, b), out in zip(parts[1:], outcomes[1:4], strict=True):
        assert out.text == a + b  # exactly the planted span went, nothing around it
        assert out.meta["dedup_substring_removed"] == 120
    assert figures["duplicate_bytes"] == 3 * 120
    assert figures["bytes"] == sum(len(d.text.encode()) for d in docs)
    assert figures["documents"] == 5 and figures["min_length"] == 100


def test_spans_shorter_than_min_length_are_kept(tmp_path: Path):
    rng = random.Random(1)
    short, exact = noise(rng, 99), noise(rng, 100)
    docs = [Doc(f"d{i}", noise(rng, 80) + short + noise(rng, 80), "t", (0, 0, i)) for i in range(3)]
    outcomes, figures = run(docs, tmp_path)
    assert [o is d for o, d in zip(outcomes, docs, strict=True)] == [True, True, True]
    assert figures["duplicate_bytes"] == 0
    # One byte longer reaches the threshold (so the check above can fail).
    docs = [Doc(f"d{i}", noise(rng, 80) + exact + noise(rng, 80), "t", (0, 0, i)) for i in range(3)]
    outcomes, figures = run(docs, tmp_path / "exact")
    assert figures["duplicate_bytes"] == 200
    assert [o.meta.get("dedup_substring_removed") for o in outcomes] == [None, 100, 100]
    # A larger min_length keeps the 100-byte repeats.
    _, figures = run(docs, tmp_path / "longer", min_length=101)
    assert figures["duplicate_bytes"] == 0


def test_documents_left_empty_or_too_short_are_dropped(tmp_path: Path):
    rng = random.Random(2)
    boiler = noise(rng, 300)
    docs = [
        Doc("orig", noise(rng, 50) + boiler, "t", (0, 0, 0)),
        Doc("copy", boiler, "t", (0, 0, 1)),  # nothing left
        Doc("short", boiler + " ok!", "t", (0, 0, 2)),  # 3 non-space characters left
        Doc("long", boiler + noise(rng, 200), "t", (0, 0, 3)),
    ]
    outcomes, _ = run(docs, tmp_path)  # default min_chars = 1: only the empty one goes
    assert outcomes[1] == (docs[1], Drop("dedup_substring.empty", value=0, threshold=1))
    assert isinstance(outcomes[2], Doc) and outcomes[2].text.split() == ["ok!"]
    outcomes, figures = run(docs, tmp_path / "strict", min_chars=20)
    assert outcomes[1] == (docs[1], Drop("dedup_substring.empty", value=0, threshold=20))
    assert outcomes[2] == (docs[2], Drop("dedup_substring.empty", value=3, threshold=20))
    assert isinstance(outcomes[3], Doc) and len(outcomes[3].text) == 200
    assert outcomes[0] is docs[0]
    assert figures["duplicate_bytes"] == 3 * 300


def test_repeats_within_one_document_and_never_across_document_ends(tmp_path: Path):
    rng = random.Random(3)
    para = noise(rng, 150)
    head, tail = noise(rng, 60), noise(rng, 60)
    docs = [
        Doc("self", noise(rng, 40) + para + noise(rng, 40) + para, "t", (0, 0, 0)),
        # "a" ends with ``head`` and "b" starts with ``tail``: their join is 120 bytes that occur in
        # "c" but never inside one earlier document, so "c" keeps them.
        Doc("a", noise(rng, 100) + head, "t", (0, 0, 1)),
        Doc("b", tail + noise(rng, 100), "t", (0, 0, 2)),
        Doc("c", noise(rng, 50) + head + tail + noise(rng, 50), "t", (0, 0, 3)),
    ]
    outcomes, figures = run(docs, tmp_path)
    assert outcomes[0].text == docs[0].text[: -len(para)]  # the second copy in the same document goes
    assert outcomes[1] is docs[1] and outcomes[2] is docs[2] and outcomes[3] is docs[3]
    assert figures["duplicate_bytes"] == 150


def test_multibyte_text_stays_valid_utf8(tmp_path: Path):
    rng = random.Random(4)
    span = "".join(rng.choice("äöüßéèñçøåαβγδεζηθ日本語中文한국어") for _ in range(60))  # >= 120 bytes
    docs = [Doc(f"d{i}", f"{noise(rng, 50)}{span}{noise(rng, 50)}", "t", (0, 0, i)) for i in range(2)]
    outcomes, _ = run(docs, tmp_path)
    out = outcomes[1]
    assert span not in out.text and out.text == docs[1].text.replace(span, "")
    out.text.encode("utf-8")  # a valid str throughout


def brute_force(texts: list[str], length: int) -> list[bytes]:
    """The reference rule: drop every byte covered by a ``length``-byte window (inside one document)
    whose bytes occurred at an earlier position of the corpus."""
    seen: set[bytes] = set()
    out = []
    for text in texts:
        raw = text.encode()
        cover = [False] * len(raw)
        for p in range(len(raw) - length + 1):
            w = raw[p : p + length]
            if w in seen:
                cover[p : p + length] = [True] * length
            seen.add(w)
        out.append(bytes(b for b, c in zip(raw, cover, strict=True) if not c))
    return out


@pytest.mark.parametrize("chunk", [1 << 22, 7])
def test_matches_brute_force_on_repetitive_random_corpora(tmp_path: Path, monkeypatch, chunk: int):
    """Small alphabet, many overlapping repeats; also with tiny suffix-array chunks (runs span chunks)."""
    monkeypatch.setattr(dedup_substring, "_CHUNK", chunk)
    rng = random.Random(5)
    for trial in range(20):
        texts = ["".join(rng.choice("ab") for _ in range(rng.randint(0, 40))) for _ in range(6)]
        docs = [Doc(f"d{i}", t, "t", (0, 0, i)) for i, t in enumerate(texts)]
        outcomes, figures = run(docs, tmp_path / str(trial), min_length=8, min_chars=0)
        expected = brute_force(texts, 8)
        got = [o.text.encode() for o in outcomes]
        assert got == expected, (trial, texts)
        assert figures["duplicate_bytes"] == sum(
            len(t.encode()) - len(e) for t, e in zip(texts, expected, strict=True)
        )


def test_output_is_deterministic_and_apply_checks_the_plan(tmp_path: Path):
    rng = random.Random(6)
    spans = [noise(rng, 130) for _ in range(5)]
    docs = [
        Doc(f"d{i}", " ".join(rng.choice(spans) + noise(rng, 30) for _ in range(4)), "t", (0, 0, i))
        for i in range(30)
    ]
    first, f1 = run(docs, tmp_path / "one")
    second, f2 = run(docs, tmp_path / "two")
    assert first == second and f1 == f2 and f1["duplicate_bytes"] > 0
    # Removed bytes reported per document add up to the plan's figure.
    assert all(isinstance(o, Doc) for o in first)
    removed = [o.meta.get("dedup_substring_removed", 0) for o in first]
    assert removed == [len(d.text.encode()) - len(o.text.encode()) for d, o in zip(docs, first, strict=True)]
    assert sum(removed) == f1["duplicate_bytes"]
    stage = SubstringDedup()
    with pytest.raises(DataError, match="changed since plan"):
        stage.apply(Doc("d0", docs[0].text + "x", "t"), tmp_path / "one")
    with pytest.raises(DataError, match="not in the planned corpus"):
        stage.apply(Doc("nope", "text", "t"), tmp_path / "one")
