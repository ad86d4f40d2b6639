"""Quality filters (Gopher, C4, FineWeb, code) on hand-made documents."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.pystdlib import stdlib_root
from lmforge.corpus.stages.base import run_doc_stages
from lmforge.corpus.stages.quality import (
    C4Filter,
    C4Params,
    CodeQuality,
    FineWebFilter,
    FineWebParams,
    GopherQuality,
    GopherQualityParams,
    GopherRepetition,
    GopherRepetitionParams,
    ngram_repetition,
)

PROSE = """The old lighthouse on the northern cape was built in 1872 to guard ships against the reef.
For more than a century its keepers lived in the small stone house beside the tower with their families.
They trimmed the wicks every evening, wound the clockwork that turned the lens and wrote the weather in a log.
When the light was automated in 1974, the last keeper moved to the village and opened a bakery near the harbour.
Today the house is a museum, and visitors can climb the narrow stairs to see the great glass lens up close.
The logbooks are kept in a glass case on the ground floor, open at a page that describes the storm of 1903.
That night the keeper stayed awake until dawn, because the wind had broken two panes and the flame kept failing.
Volunteers from the village still paint the tower every summer, and the work usually takes about three weeks."""


def doc(text: str, domain: str = "prose") -> Doc:
    return Doc("d", text, domain)


PROSE_STAGES = [GopherQuality(), GopherRepetition(), C4Filter(), FineWebFilter()]


def test_good_prose_passes_every_prose_filter():
    for stage in PROSE_STAGES:
        out = stage.process(doc(PROSE))
        assert isinstance(out, Doc), (stage.name, out)
        assert out.text == PROSE


# ------------------------------------------------------------------------------------------ gopher quality


N_PROSE = len(PROSE.split())


@pytest.mark.parametrize(
    ("text", "rule", "value", "threshold"),
    [
        ("Too short to be a document, with only a handful of words in it.", "word_count", 14, 50),
        # 20 + 16 + 3 + 3 characters over 4 words; 1 + 2 + 3 + 2 + 3 + 2 over 6
        (
            " ".join(["internationalisation", "characterisation", "the", "and"] * 30),
            "mean_word_length",
            10.5,
            10,
        ),
        (" ".join(["a", "of", "the", "to", "and", "is"] * 20), "mean_word_length", 13 / 6, 3),
        (PROSE + " #tag" * 50, "hash_ratio", 50 / (N_PROSE + 50), 0.1),
        (PROSE + " and so on..." * 40, "ellipsis_ratio", 40 / (N_PROSE + 120), 0.1),
        (
            "\n".join(f"- item number {i} of the list and the rest" for i in range(40)),
            "bullet_lines",
            1.0,
            0.9,
        ),
        (
            "\n".join(
                f"and then the long story of line {i} went on and on for a while..." for i in range(40)
            ),
            "ellipsis_lines",
            1.0,
            0.3,
        ),
        ("the and " + " ".join(str(i * 7919) for i in range(200)), "alpha_words", 2 / 202, 0.8),
        (" ".join(["quickly", "running", "horses", "jumped", "over", "fences"] * 20), "stop_words", 0, 2),
        ("The horses ran over fences quickly today. " * 10, "stop_words", 1, 2),  # "the" only
    ],
)
def test_gopher_quality_rules(text, rule, value, threshold):
    """Each rule names itself, the value it measured and the bound it failed."""
    assert GopherQuality().process(doc(text)) == Drop(f"gopher_quality.{rule}", None, value, threshold)


def test_gopher_quality_thresholds_are_configurable():
    short = doc("The cat and the dog sat on the mat together.")
    assert GopherQuality().process(short) == Drop("gopher_quality.word_count", value=10, threshold=50)
    assert isinstance(GopherQuality(GopherQualityParams(min_words=5)).process(short), Doc)
    assert isinstance(GopherQuality(GopherQualityParams(min_words=None)).process(short), Doc)


# --------------------------------------------------------------------------------------- gopher repetition


def reference_ngram_stats(words: list[str], n: int) -> tuple[int, int]:
    """The definitions, written the slow obvious way."""
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    counts = Counter(grams)
    top, count = max(counts.items(), key=lambda kv: kv[1])  # first maximum in insertion order
    seen: set[tuple[str, ...]] = set()
    covered: set[int] = set()
    for i, g in enumerate(grams):
        if g in seen:
            covered.update(range(i, i + n))
        seen.add(g)
    return len(" ".join(top)) * count, sum(len(words[j]) for j in covered)


def test_ngram_statistics_match_the_definition():
    rng = random.Random(0)
    vocab = ["a", "bb", "ccc", "the", "house", "of", "x", "longerword"]
    for _ in range(300):
        words = [rng.choice(vocab[: rng.randint(2, len(vocab))]) for _ in range(rng.randint(2, 60))]
        got = {n: (top, dup) for n, top, dup in ngram_repetition(words, 10)}
        assert sorted(got) == list(range(2, min(10, len(words)) + 1))
        for n, stats in got.items():
            assert stats == reference_ngram_stats(words, n), (words, n)


def test_gopher_repetition_early_exit_changes_no_decision():
    """The stage stops at the first failing rule or when no later rule can fail; checking every level
    with the definition gives the same decision."""
    rng = random.Random(1)
    vocab = ["alpha", "be", "c", "delta", "echo", "f", "golf", "hotel", "india", "j"]
    no_line_rules = {
        f"max_dup_{k}": None for k in ("line_frac", "para_frac", "line_char_frac", "para_char_frac")
    }
    for _ in range(300):
        words = [rng.choice(vocab[: rng.randint(3, 10)]) for _ in range(rng.randint(5, 80))]
        text = " ".join(words)
        params = GopherRepetitionParams(
            **no_line_rules,
            top_ngram_char_frac={n: rng.uniform(0.05, 0.6) for n in (2, 3, 4)},
            dup_ngram_char_frac={n: rng.uniform(0.05, 0.9) for n in range(5, 11)},
        )
        expected = None
        for n in range(2, 11):
            if n > len(words):
                break
            top, dup = reference_ngram_stats(words, n)
            if n in params.top_ngram_char_frac and top / len(text) > params.top_ngram_char_frac[n]:
                expected = f"gopher_repetition.top_{n}_gram"
                break
            if n in params.dup_ngram_char_frac and dup / len(text) > params.dup_ngram_char_frac[n]:
                expected = f"gopher_repetition.dup_{n}_gram"
                break
        out = GopherRepetition(params).process(doc(text))
        assert (out.reason if isinstance(out, Drop) else None) == expected, (words, params)


LINES = PROSE.splitlines()
REPEATED_40 = " ".join(PROSE.split()[:40] * 2 + PROSE.split()[40:])


@pytest.mark.parametrize(
    ("text", "rule", "value", "threshold"),
    [
        ("\n".join([LINES[0]] * 5 + LINES[1:4]), "dup_line_frac", lambda t: 4 / 8, 0.3),
        (PROSE + "\n\n" + PROSE + "\n\n" + PROSE, "dup_para_frac", lambda t: 2 / 3, 0.3),
        (
            "\n\n".join([PROSE, "A different paragraph.", "And another one.", PROSE]),
            "dup_para_char_frac",
            lambda t: len(PROSE) / len(t),
            0.2,
        ),
        (
            PROSE + "\n" + "\n".join(LINES[:3]),
            "dup_line_char_frac",
            lambda t: len("".join(LINES[:3])) / len(t),
            0.2,
        ),
        # "buy cheap" is the first of the two most frequent 2-grams, 40 times
        (" ".join(["buy cheap", "shoes"] * 40 + PROSE.split()), "top_2_gram", lambda t: 9 * 40 / len(t), 0.2),
        (REPEATED_40, "dup_5_gram", lambda t: reference_ngram_stats(t.split(), 5)[1] / len(t), 0.15),
    ],
)
def test_gopher_repetition_rules(text, rule, value, threshold):
    want = Drop(f"gopher_repetition.{rule}", None, value(text), threshold)
    assert GopherRepetition().process(doc(text)) == want


def test_gopher_repetition_rules_can_be_turned_off():
    text = " ".join(PROSE.split()[:40] * 2 + PROSE.split()[40:])
    params = GopherRepetitionParams(dup_ngram_char_frac={}, top_ngram_char_frac={2: 0.2})
    assert isinstance(GopherRepetition(params).process(doc(text)), Doc)


# -------------------------------------------------------------------------------------------------- C4


def test_c4_line_rules_edit_the_page():
    lines = PROSE.splitlines()
    text = "\n".join(
        [
            "Home | About | Contact",  # no terminal punctuation
            lines[0],
            "Read more.",  # too few words
            "Please enable JavaScript in your browser to see this page.",
            lines[1] + "[1]",  # citation mark removed
            "By using this site you agree to our terms of use and the cookie policy.",
            lines[2],
            "And the story went on and on...",  # ellipsis
            lines[3],
        ]
    )
    out = C4Filter().process(doc(text))
    assert isinstance(out, Doc)
    assert out.text == "\n".join([lines[0], lines[1], lines[2], lines[3]])


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ("Lorem ipsum dolor sit amet, consectetur adipiscing elit.", "lorem_ipsum"),
        ("The configuration looks like {debug: true} in the file.", "curly_bracket"),
    ],
)
def test_c4_page_rules(extra, rule):
    """A page rule that matches rather than measures gives the line it matched as the value."""
    assert C4Filter().process(doc(PROSE + "\n" + extra)) == Drop(f"c4.{rule}", value=extra)
    long = "{" + " word" * 100 + "."
    assert C4Filter().process(doc(PROSE + "\n" + long)).value == long[:199] + "…"  # long lines cut


def test_c4_too_few_sentences_and_bad_words():
    two = "\n".join(PROSE.splitlines()[:2])
    assert C4Filter().process(doc(two)) == Drop("c4.too_few_sentences", value=2, threshold=3)
    assert isinstance(C4Filter(C4Params(min_sentences=2)).process(doc(two)), Doc)
    assert C4Filter().process(doc("menu\nlogin\nsearch")) == Drop("c4.empty")
    assert isinstance(C4Filter().process(doc(PROSE)), Doc)  # no list given: the rule is off
    bad = C4Filter(C4Params(bad_words=["harbour", "bakery"])).process(doc(PROSE))
    assert bad == Drop("c4.bad_words", value="bakery")  # the first in the text
    assert isinstance(C4Filter(C4Params(bad_words=["bake"])).process(doc(PROSE)), Doc)  # whole words


# ---------------------------------------------------------------------------------------------- FineWeb


def test_fineweb_rules():
    listy = "\n".join(f"Item {i}: blue cotton shirt size {i}" for i in range(30))
    assert FineWebFilter().process(doc(listy)) == Drop("fineweb.line_punct_ratio", value=0.0, threshold=0.12)
    short = "\n".join(f"Line {i} is short." for i in range(30)) + "\n" + PROSE
    assert FineWebFilter().process(doc(short)) == Drop(
        "fineweb.short_line_ratio", value=30 / 38, threshold=0.67
    )
    share = "Share this article with your friends on social media today."
    dup = PROSE + f"\n{share}\n" * 2
    want = Drop("fineweb.char_dup_ratio", value=len(share) / (len(dup) - dup.count("\n")), threshold=0.01)
    assert FineWebFilter().process(doc(dup)) == want
    newline_rule = FineWebFilter(FineWebParams(max_newline_word_ratio=0.04))  # 7 newlines, 158 words
    assert newline_rule.process(doc(PROSE)) == Drop("fineweb.list_ratio", value=7 / N_PROSE, threshold=0.04)
    lenient = FineWebParams(max_char_dup_ratio=0.2)
    assert isinstance(FineWebFilter(lenient).process(doc(dup)), Doc)


# ------------------------------------------------------------------------------------------------- code

STDLIB_MODULES = [
    "abc.py", "bisect.py", "calendar.py", "colorsys.py", "copy.py", "csv.py", "difflib.py", "fnmatch.py",
    "fractions.py", "functools.py", "glob.py", "heapq.py", "linecache.py", "numbers.py",
    "operator.py", "queue.py", "random.py", "sched.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py", "timeit.py",
]  # fmt: skip


def test_prose_rules_destroy_good_code_while_code_quality_keeps_it():
    """The prose chain drops a source file or (C4's line rules) cuts it down to its docstring
    sentences; FineWeb's rules alone drop nearly every file. code_quality keeps them unchanged."""
    fineweb_drops = 0
    for name in STDLIB_MODULES:
        source = (stdlib_root() / name).read_text()
        [out] = run_doc_stages(PROSE_STAGES, [doc(source, "code")])
        if isinstance(out, Doc):
            kept_lines = len(out.text.splitlines())
            assert kept_lines < 0.25 * len(source.splitlines()), name
            assert not any(line.startswith(" ") for line in out.text.splitlines()), name  # no indentation
        fineweb_drops += isinstance(FineWebFilter().process(doc(source, "code")), Drop)
        assert CodeQuality().process(doc(source, "code")) == doc(source, "code"), name
    assert fineweb_drops >= 0.9 * len(STDLIB_MODULES)


def test_code_quality_removes_minified_generated_and_blob_files():
    minified = "var a=" + ";".join(f"function f{i}(x){{return x*{i}+{i}}}" for i in range(120)) + ";"
    got = CodeQuality().process(doc(minified, "code"))
    assert got == Drop("code_quality.max_line_length", value=len(minified), threshold=1000)
    row = "x = [" + ", ".join(str(j) for j in range(40)) + "]"
    wide = "\n".join([row] * 30)
    got = CodeQuality().process(doc(wide, "code"))
    assert got == Drop("code_quality.mean_line_length", value=len(wide) / 30, threshold=100)
    generated = (
        "# -*- coding: utf-8 -*-\n# Generated by the protocol buffer compiler.  DO NOT EDIT!\n"
        "# source: person.proto\nimport sys\n\nclass Person:\n    pass\n"
    )
    got = CodeQuality().process(doc(generated, "code"))
    assert got == Drop("code_quality.autogenerated", value="do not edit", threshold=5)  # the marker found
    keyword_py = (stdlib_root() / "keyword.py").read_text()  # "This file is automatically generated"
    got = CodeQuality().process(doc(keyword_py, "code"))
    assert got == Drop("code_quality.autogenerated", value="automatically generated", threshold=5)
    blob = (
        "DATA = (\n"
        + "\n".join(f'    "{"QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo" * 2}"' for _ in range(20))
        + "\n)\n"
    )
    got = CodeQuality().process(doc(blob, "code"))
    assert got.reason == "code_quality.encoded_data" and 0.5 < got.value < 1 and got.threshold == 0.5
    symbols = "\n".join("{}[]();,.<>+-*/=&|!~^%" * 2 for _ in range(20))
    got = CodeQuality().process(doc(symbols, "code"))
    assert got == Drop("code_quality.alnum_fraction", value=0.0, threshold=0.25)
    assert CodeQuality().process(doc(" \n ", "code")) == Drop("code_quality.empty")


def test_every_stage_pickles_and_names_its_rules():
    import pickle

    bad = {"gopher_repetition": "\n".join(["same line"] * 10)}
    for stage in [*PROSE_STAGES, CodeQuality()]:
        clone = pickle.loads(pickle.dumps(stage))
        out = clone.process(doc(bad.get(stage.name, " ")))
        assert isinstance(out, Drop) and out.reason.startswith(stage.name + "."), out
