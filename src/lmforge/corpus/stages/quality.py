"""Heuristic quality filters: Gopher, C4, FineWeb for prose and web text, and a rule set for source code.

Every stage reads only the document's text (pure functions of text and parameters), checks its rules
from the cheapest to the dearest and stops at the first that fails; the removal reason names the rule
(``"<stage>.<rule>"``) and carries what the rule measured (``Drop.value``) and the bound it failed
(``Drop.threshold``); rules that match rather than measure give the match as ``value`` (the bad word,
the line with "lorem ipsum" or ``{``, the auto-generated marker). Every threshold is a parameter;
``None`` turns a rule off.

Hand-written rather than wrapping datatrove's filter blocks: those split words with a spaCy tokenizer
(a heavy dependency, and most of their run time); here words come from whitespace and precompiled
regular expressions, and the n-gram statistics are computed with numpy in a few vectorised passes.
``benchmarks/data_pipeline.py`` measures the two side by side.

Definitions used by the rules (the papers leave them open; these are written down so a reader can
check a decision by hand):

* *token*: a maximal run of non-whitespace characters (``text.split()``);
* *word*: a token with at least one letter, digit or underscore (the rest are *symbols*); a
  word's length excludes punctuation at its start and end (``"(word),"`` has length 4);
* *line*: text between newlines; *paragraph*: text between runs of two or more newlines.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, Knob, StageParams

# ---------------------------------------------------------------------------------------------------
# Shared text statistics


# A word from its first to its last letter/digit: "(well-known)," -> "well-known". One match per
# token that has a word character, so the count of matches is the number of words. (Patterns that
# start with a character class let the regex engine skip ahead in C; a leading look-behind would not.)
_WORD_CORE = re.compile(r"\w(?:\S*\w)?")
# tokens with at least one letter: from the first letter to the end of the token, one match each
_ALPHA_TOKEN = re.compile(r"[^\W\d_]\S*")
_PARAGRAPH_BREAK = re.compile(r"\n{2,}")
_LINE_BREAKS = re.compile(r"\n+")
# Unicode sentence terminators of the major scripts (Latin, CJK full-width, Arabic, Devanagari,
# Ethiopic, Armenian, Myanmar, ...) and the ellipsis character.
TERMINAL_PUNCTUATION: tuple[str, ...] = (
    ".", "!", "?", "…", "‼", "‽", "⁇", "⁈", "⁉", "。", "．", "！", "？", "｡",
    "։", "؟", "۔", "।", "॥", "။", "።", "፧", "፨", "᙮", "᠃", "᠉", "꓿", "꘎", "꘏", "꛳", "꛷",
)  # fmt: skip


def _count_lines(text: str) -> int:
    """Number of lines as ``str.splitlines`` would give for ``\\n``-separated text."""
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items that repeat an earlier one, characters in those repeats)."""
    unique = set(items)
    return len(items) - len(unique), sum(map(len, items)) - sum(map(len, unique))


# ---------------------------------------------------------------------------------------------------
# Gopher quality


class GopherQualityParams(StageParams):
    """Gopher's document quality rules (Rae et al. 2021, "Scaling Language Models: Methods, Analysis &
    Insights from Training Gopher", appendix A.1.1, the MassiveText quality filter).

    Defaults are the paper's: keep documents with 50 to 100,000 words, a mean word length of 3 to 10
    characters, a ratio of ``#`` and of ellipses to words of at most 0.1, at most 90% of lines starting
    with a bullet, at most 30% of lines ending with an ellipsis, at least 80% of words containing an
    alphabetic character and at least two of the stop words "the, be, to, of, and, that, have, with".
    Which characters count as bullets is not given in the paper; the default set is ours (datatrove's
    reference filter uses "•" and "-").
    """

    min_words: int | None = Field(50, description="Fewest words (Gopher: 50).")
    max_words: int | None = Field(100_000, description="Most words (Gopher: 100,000).")
    min_mean_word_length: float | None = Field(3.0, description="Smallest mean word length (Gopher: 3).")
    max_mean_word_length: float | None = Field(10.0, description="Largest mean word length (Gopher: 10).")
    max_hash_ratio: float | None = Field(0.1, description="Most '#' per token (Gopher: 0.1).")
    max_ellipsis_ratio: float | None = Field(
        0.1, description="Most ellipses ('...' or '…') per token (Gopher: 0.1)."
    )
    max_bullet_lines: float | None = Field(
        0.9, description="Largest fraction of lines starting with a bullet (Gopher: 0.9)."
    )
    max_ellipsis_lines: float | None = Field(
        0.3, description="Largest fraction of lines ending with an ellipsis (Gopher: 0.3)."
    )
    min_alpha_words: float | None = Field(
        0.8, description="Smallest fraction of tokens with an alphabetic character (Gopher: 0.8)."
    )
    min_stop_words: int | None = Field(
        2, description="Fewest distinct stop words present, case-insensitive (Gopher: 2)."
    )
    stop_words: list[str] = Field(
        ["the", "be", "to", "of", "and", "that", "have", "with"], description="Gopher's stop words."
    )
    bullets: list[str] = Field(
        ["•", "‣", "◦", "▪", "●", "-", "*"], description="Characters that start a bullet line."
    )


class GopherQuality(DocStage):
    """Drops documents that break one of Gopher's quality rules; the text is not changed."""

    name = "gopher_quality"
    Params = GopherQualityParams
    filters = True
    # strict end: the paper's values (its only published setting); lenient: bounds nothing reaches
    strictness = (
        Knob("min_words", 0, 50, integer=True),
        Knob("min_mean_word_length", 0.0, 3.0),
        Knob("max_mean_word_length", 100.0, 10.0),
        Knob("max_hash_ratio", 1.0, 0.1),
        Knob("max_ellipsis_ratio", 1.0, 0.1),
        Knob("max_bullet_lines", 1.0, 0.9),
        Knob("max_ellipsis_lines", 1.0, 0.3),
        Knob("min_alpha_words", 0.0, 0.8),
        Knob("min_stop_words", 0, 2, integer=True),
    )

    def __init__(self, params: GopherQualityParams | None = None):
        super().__init__(params)
        p = self.params
        words = "|".join(re.escape(w) for w in sorted(set(p.stop_words), key=len, reverse=True))
        self._stop = re.compile(rf"\b(?:{words})\b", re.IGNORECASE) if words else None
        bullets = "".join(re.escape(b) for b in p.bullets)
        self._bullet = re.compile(rf"^[^\S\n]*[{bullets}]", re.MULTILINE) if bullets else None
        self._ellipsis_line = re.compile(r"(?:\.\.\.|…)[^\S\n]*$", re.MULTILINE)

    def process(self, doc: Doc) -> Doc | Drop:
        p: GopherQualityParams = self.params
        text = doc.text
        n_tokens = len(text.split())
        words = _WORD_CORE.findall(text)
        n_words = len(words)
        if p.min_words is not None and n_words < p.min_words:
            return self.drop("word_count", value=n_words, threshold=p.min_words)
        if p.max_words is not None and n_words > p.max_words:
            return self.drop("word_count", value=n_words, threshold=p.max_words)
        if n_words == 0:
            return self.drop("word_count", value=0, threshold=p.min_words)

        if p.min_mean_word_length is not None or p.max_mean_word_length is not None:
            mean = sum(map(len, words)) / n_words
            if p.min_mean_word_length is not None and mean < p.min_mean_word_length:
                return self.drop("mean_word_length", value=mean, threshold=p.min_mean_word_length)
            if p.max_mean_word_length is not None and mean > p.max_mean_word_length:
                return self.drop("mean_word_length", value=mean, threshold=p.max_mean_word_length)

        if p.max_hash_ratio is not None:
            ratio = text.count("#") / n_tokens
            if ratio > p.max_hash_ratio:
                return self.drop("hash_ratio", value=ratio, threshold=p.max_hash_ratio)
        if p.max_ellipsis_ratio is not None:
            ratio = (text.count("...") + text.count("…")) / n_tokens
            if ratio > p.max_ellipsis_ratio:
                return self.drop("ellipsis_ratio", value=ratio, threshold=p.max_ellipsis_ratio)

        n_lines = _count_lines(text)
        if p.max_bullet_lines is not None and self._bullet is not None:
            frac = len(self._bullet.findall(text)) / n_lines
            if frac > p.max_bullet_lines:
                return self.drop("bullet_lines", value=frac, threshold=p.max_bullet_lines)
        if p.max_ellipsis_lines is not None:
            frac = len(self._ellipsis_line.findall(text)) / n_lines
            if frac > p.max_ellipsis_lines:
                return self.drop("ellipsis_lines", value=frac, threshold=p.max_ellipsis_lines)

        if p.min_alpha_words is not None:
            frac = len(_ALPHA_TOKEN.findall(text)) / n_tokens
            if frac < p.min_alpha_words:
                return self.drop("alpha_words", value=frac, threshold=p.min_alpha_words)

        if p.min_stop_words:
            seen: set[str] = set()
            for m in self._stop.finditer(text) if self._stop is not None else ():
                seen.add(m.group().lower())
                if len(seen) >= p.min_stop_words:
                    break
            else:
                return self.drop("stop_words", value=len(seen), threshold=p.min_stop_words)
        return doc


# ---------------------------------------------------------------------------------------------------
# Gopher repetition


def ngram_repetition(words: list[str], max_n: int) -> Iterator[tuple[int, int, int]]:
    """For n = 2 ... ``max_n``: ``(n, top_chars, dup_chars)`` of the word sequence ``words``.

    ``top_chars`` = len(" ".join(g)) x count(g) for the most frequent n-gram g (ties: the one seen
    first); ``dup_chars`` = sum of len(w) over the words w covered by at least one n-gram occurrence
    that equals an earlier occurrence.

    Words get integer ids, then n-gram ids are built level by level,
    ``id_n[i] = rank(id_{n-1}[i] * W + id_1[i + n - 1])`` with ``np.unique``, which also gives each
    n-gram's count and first occurrence: exact (no hashing), one sort per level. A generator, so a
    caller can stop at the first level that fails its rule.
    """
    n_words = len(words)
    if n_words < 2:
        return
    table: dict[str, int] = {}
    # id of a word = index of its first occurrence (dict.setdefault keeps the first one given)
    word_ids = np.fromiter(map(table.setdefault, words, range(n_words)), dtype=np.int64, count=n_words)
    lengths = np.fromiter(map(len, words), dtype=np.int64, count=n_words)
    cum = np.concatenate(([0], np.cumsum(lengths)))
    ids = word_ids
    all_unique = False  # once no n-gram repeats, no longer one does either
    for n in range(2, max_n + 1):
        m = n_words - n + 1
        if m <= 0:
            return
        if all_unique:
            yield n, int(cum[n] - cum[0] + n - 1), 0
            continue
        _, first, inverse, counts = np.unique(
            ids[:m] * n_words + word_ids[n - 1 :], return_index=True, return_inverse=True, return_counts=True
        )
        ids = inverse.astype(np.int64, copy=False)
        top = int(counts.max())
        where = int(first[counts == top].min())
        top_chars = int(cum[where + n] - cum[where] + n - 1) * top
        all_unique = len(counts) == m
        if all_unique:
            yield n, top_chars, 0
            continue
        repeat = np.ones(m, dtype=bool)
        repeat[first] = False
        starts = np.flatnonzero(repeat)
        # +1 where a repeated n-gram starts, -1 where it ends: positive prefix sums = covered words
        cover = np.bincount(starts, minlength=n_words + 1) - np.bincount(starts + n, minlength=n_words + 1)
        covered = np.cumsum(cover[:n_words]) > 0
        yield n, top_chars, int(lengths[covered].sum())


class GopherRepetitionParams(StageParams):
    """Gopher's repetition rules (Rae et al. 2021, appendix A.1.1, table A1).

    Defaults are the paper's table: duplicate line fraction 0.30, duplicate paragraph fraction 0.30,
    duplicate line character fraction 0.20, duplicate paragraph character fraction 0.20; top n-gram
    character fraction 0.20 / 0.18 / 0.16 for n = 2 / 3 / 4; duplicate n-gram character fraction 0.15,
    0.14, 0.13, 0.12, 0.11, 0.10 for n = 5 ... 10.

    Measures (character fractions are over all characters of the document, as in datatrove's
    reference filter): a *duplicate* line or paragraph is one equal to an earlier one; the *top n-gram*
    fraction is (characters of the most frequent word n-gram, words joined by single spaces) x (its
    count); the *duplicate n-gram* fraction counts the characters of the words covered by any n-gram
    occurrence that repeats an earlier occurrence, each word once however many such n-grams overlap it
    (the paper: "taking care not to count characters that occur in overlapping n-grams more than once").
    Words for n-grams are whitespace tokens.
    """

    max_dup_line_frac: float | None = Field(0.30, description="Duplicate lines / lines (Gopher: 0.30).")
    max_dup_para_frac: float | None = Field(
        0.30, description="Duplicate paragraphs / paragraphs (Gopher: 0.30)."
    )
    max_dup_line_char_frac: float | None = Field(
        0.20, description="Characters in duplicate lines / characters (Gopher: 0.20)."
    )
    max_dup_para_char_frac: float | None = Field(
        0.20, description="Characters in duplicate paragraphs / characters (Gopher: 0.20)."
    )
    top_ngram_char_frac: dict[int, float] = Field(
        {2: 0.20, 3: 0.18, 4: 0.16},
        description="n -> largest character fraction of the most frequent n-gram (Gopher: 2: 0.20, 3: 0.18, 4: 0.16).",
    )
    dup_ngram_char_frac: dict[int, float] = Field(
        {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="n -> largest character fraction in duplicate n-grams (Gopher: 0.15 for 5 down to 0.10 for 10).",
    )


class GopherRepetition(DocStage):
    """Drops documents with too much repeated content, by Gopher's line, paragraph and n-gram rules
    (n-gram statistics from :func:`ngram_repetition`)."""

    name = "gopher_repetition"
    Params = GopherRepetitionParams
    filters = True
    # strict end: the paper's table (the n-gram tables entry by entry from 1.0)
    strictness = (
        Knob("max_dup_line_frac", 1.0, 0.30),
        Knob("max_dup_para_frac", 1.0, 0.30),
        Knob("max_dup_line_char_frac", 1.0, 0.20),
        Knob("max_dup_para_char_frac", 1.0, 0.20),
        Knob("top_ngram_char_frac", 1.0, {2: 0.20, 3: 0.18, 4: 0.16}),
        Knob("dup_ngram_char_frac", 1.0, {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}),
    )

    def process(self, doc: Doc) -> Doc | Drop:
        p: GopherRepetitionParams = self.params
        text = doc.text
        n_chars = len(text)
        if n_chars == 0:
            return self.drop("empty")
        stripped = text.strip()

        for name, split, max_frac, max_char_frac in (
            ("para", _PARAGRAPH_BREAK.split, p.max_dup_para_frac, p.max_dup_para_char_frac),
            ("line", _LINE_BREAKS.split, p.max_dup_line_frac, p.max_dup_line_char_frac),
        ):
            if max_frac is None and max_char_frac is None:
                continue
            parts = split(stripped)
            dups, dup_chars = _duplicates(parts)
            if max_frac is not None and dups / len(parts) > max_frac:
                return self.drop(f"dup_{name}_frac", value=dups / len(parts), threshold=max_frac)
            if max_char_frac is not None and dup_chars / n_chars > max_char_frac:
                return self.drop(f"dup_{name}_char_frac", value=dup_chars / n_chars, threshold=max_char_frac)

        failed = self._ngram_rules(text.split(), n_chars)
        if failed is None:
            return doc
        rule, frac, bound = failed
        return self.drop(rule, value=frac, threshold=bound)

    def _ngram_rules(self, words: list[str], n_chars: int) -> tuple[str, float, float] | None:
        """The first n-gram rule that fails: (rule, measured fraction, its bound); None if all pass."""
        p: GopherRepetitionParams = self.params
        levels = set(p.top_ngram_char_frac) | set(p.dup_ngram_char_frac)
        if not levels:
            return None
        last_top = max(p.top_ngram_char_frac, default=0)
        for n, top_chars, dup_chars in ngram_repetition(words, max(levels)):
            if n in p.top_ngram_char_frac and top_chars / n_chars > p.top_ngram_char_frac[n]:
                return f"top_{n}_gram", top_chars / n_chars, p.top_ngram_char_frac[n]
            if n in p.dup_ngram_char_frac:
                frac = dup_chars / n_chars
                if frac > p.dup_ngram_char_frac[n]:
                    return f"dup_{n}_gram", frac, p.dup_ngram_char_frac[n]
                # The words covered by repeated n-grams include those covered by repeated (n+1)-grams
                # (both halves of a repeated (n+1)-gram are repeated n-grams), so the fraction only
                # falls as n grows: once it is under every later threshold, no later rule can fail.
                later = [t for m, t in p.dup_ngram_char_frac.items() if m > n]
                if n >= last_top and frac <= min(later, default=1.0):
                    return None
        return None


# ---------------------------------------------------------------------------------------------------
# C4


_SENTENCE_END = re.compile(r"[.!?]+['\"”’)\]]*(?=\s|$)")


class C4Params(StageParams):
    """The C4 cleaning rules (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a
    Unified Text-to-Text Transformer", section 2.2) with the values of its released filter
    (``c4_utils.py`` in TensorFlow Datasets).

    Line level (the line is removed): no terminal punctuation mark (``.``, ``?``, ``!``, ``"``) at the
    end, or ending with an ellipsis; fewer than 5 words; a word longer than 1,000 characters; the word
    "javascript"; a cookie or policy notice ("terms of use", "privacy policy", "cookie policy", "uses
    cookies", "use of cookies", "use cookies"). Wikipedia-style citation marks (``[1]``, ``[edit]``,
    ``[citation needed]``) are removed from lines. Page level (the document is dropped): "lorem ipsum",
    a curly bracket, fewer than 3 sentences in the kept lines, a word from ``bad_words`` (C4 used the
    "List of Dirty, Naughty, Obscene, and Otherwise Bad Words"; no list ships here, so this rule is off
    until a list is given). As in the released filter, "lorem ipsum" and curly brackets are looked for
    in the lines that pass the line rules.

    Sentences are counted with a rule (a run of ``.!?`` followed by optional closing quotes or brackets
    and whitespace or the end of the line) instead of C4's punkt tokenizer: no model to download; an
    abbreviation such as "e.g. " counts as a sentence end.
    """

    end_marks: list[str] = Field([".", "?", "!", '"'], description="Terminal punctuation (C4).")
    filter_no_terminal_punct: bool = Field(True, description="Remove lines without terminal punctuation.")
    filter_ellipsis_lines: bool = Field(True, description="Remove lines ending with '...' (C4).")
    min_words_per_line: int | None = Field(5, description="Remove lines with fewer words (C4: 5).")
    max_word_length: int | None = Field(1000, description="Remove lines with a longer word (C4: 1000).")
    remove_citations: bool = Field(True, description="Strip [1], [edit], [citation needed] marks (C4).")
    filter_javascript: bool = Field(True, description="Remove lines mentioning 'javascript' (C4).")
    policy_substrings: list[str] = Field(
        ["terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies"],
        description="Remove lines containing any of these, case-insensitive (C4).",
    )
    filter_lorem_ipsum: bool = Field(True, description="Drop pages containing 'lorem ipsum' (C4).")
    filter_curly_bracket: bool = Field(True, description="Drop pages containing '{' (C4).")
    min_sentences: int | None = Field(3, description="Drop pages with fewer sentences (C4: 3).")
    bad_words: list[str] = Field(
        [], description="Drop pages containing any of these words (whole words, case-insensitive)."
    )


_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_EXCERPT = 200


def _excerpt(line: str) -> str:
    """A matched line as a removal's ``value``: its first 200 characters."""
    return line if len(line) <= _EXCERPT else line[: _EXCERPT - 1] + "…"


class C4Filter(DocStage):
    """Removes lines by C4's line rules and drops pages by its page rules."""

    name = "c4"
    Params = C4Params
    filters = True
    # strict end: C4's released filter; its on/off rules are on from level 50 (a rule the recipe turns
    # off stays off)
    strictness = (
        Knob("min_words_per_line", 0, 5, integer=True),
        Knob("min_sentences", 0, 3, integer=True),
        Knob("filter_no_terminal_punct", False, True),
        Knob("filter_ellipsis_lines", False, True),
        Knob("filter_javascript", False, True),
        Knob("filter_lorem_ipsum", False, True),
        Knob("filter_curly_bracket", False, True),
    )

    def __init__(self, params: C4Params | None = None):
        super().__init__(params)
        p = self.params
        # one search per line finds whichever special phrase is present; most lines have none
        phrases = []
        if p.filter_lorem_ipsum:
            phrases.append("lorem ipsum")
        if p.filter_javascript:
            phrases.append("javascript")
        phrases += p.policy_substrings
        self._phrases = re.compile("|".join(re.escape(s) for s in phrases)) if phrases else None
        self._policy = set(p.policy_substrings)
        self._end_marks = tuple(p.end_marks)
        words = "|".join(re.escape(w.lower()) for w in p.bad_words if w.strip())
        self._bad = re.compile(rf"(?<!\w)(?:{words})(?!\w)") if words else None

    def process(self, doc: Doc) -> Doc | Drop:
        p: C4Params = self.params
        kept: list[str] = []
        sentences = 0
        for raw in doc.text.splitlines():
            line = raw.strip()
            if not line:
                continue
            words = line.split()
            if p.max_word_length is not None and max(map(len, words)) > p.max_word_length:
                continue
            if p.remove_citations and "[" in line:
                line = _CITATION.sub("", line).strip()
                words = line.split()
            if p.filter_no_terminal_punct and not line.endswith(self._end_marks):
                continue
            if p.filter_ellipsis_lines and line.endswith("..."):
                continue
            if p.min_words_per_line is not None and len(words) < p.min_words_per_line:
                continue
            # C4's order: lorem ipsum (page), javascript (line), curly bracket (page), policy (line)
            lower = line.lower()
            special = self._phrases is not None and self._phrases.search(lower) is not None
            if special and p.filter_lorem_ipsum and "lorem ipsum" in lower:
                return self.drop("lorem_ipsum", value=_excerpt(line))
            if special and p.filter_javascript and "javascript" in lower:
                continue
            if p.filter_curly_bracket and "{" in line:
                return self.drop("curly_bracket", value=_excerpt(line))
            if special and any(s in lower for s in self._policy):
                continue
            sentences += max(1, len(_SENTENCE_END.findall(line)))
            kept.append(line)
        if not kept:
            return self.drop("empty")
        if p.min_sentences is not None and sentences < p.min_sentences:
            return self.drop("too_few_sentences", value=sentences, threshold=p.min_sentences)
        text = "\n".join(kept)
        bad = self._bad.search(text.lower()) if self._bad is not None else None
        if bad is not None:
            return self.drop("bad_words", value=bad.group())
        return doc if text == doc.text else replace(doc, text=text)


# ---------------------------------------------------------------------------------------------------
# FineWeb


class FineWebParams(StageParams):
    """FineWeb's three extra rules (Penedo et al. 2024, "The FineWeb Datasets: Decanting the Web for the
    Finest Text Data at Scale", section 3.6), with the thresholds of the filter that built FineWeb
    (datatrove's ``FineWebQualityFilter`` defaults).

    Over non-blank lines: drop when the fraction of lines ending in terminal punctuation is below 0.12;
    when the fraction of lines of at most 30 characters is above 0.67; when the characters of lines that
    repeat an earlier line are more than 0.01 of the document's characters (newlines not counted).
    ``max_newline_word_ratio`` (newlines per word; datatrove's fourth rule, 0.3 there) is not one of
    the paper's three and is off by default.
    """

    min_line_punct_ratio: float | None = Field(
        0.12, description="Smallest fraction of lines ending in terminal punctuation (FineWeb: 0.12)."
    )
    max_short_line_ratio: float | None = Field(
        0.67, description="Largest fraction of short lines (FineWeb: 0.67)."
    )
    short_line_length: int = Field(30, description="A line of at most this many characters is short (30).")
    max_char_dup_ratio: float | None = Field(
        0.01, description="Largest fraction of characters in duplicated lines (FineWeb: 0.01)."
    )
    max_newline_word_ratio: float | None = Field(
        None, description="Largest ratio of newlines to words (off; datatrove uses 0.3)."
    )
    terminal_punctuation: list[str] = Field(
        list(TERMINAL_PUNCTUATION), description="Characters that end a sentence."
    )


class FineWebFilter(DocStage):
    """Drops documents by FineWeb's line-punctuation, short-line and duplicated-line rules."""

    name = "fineweb"
    Params = FineWebParams
    filters = True
    # strict end: the thresholds that built FineWeb
    strictness = (
        Knob("min_line_punct_ratio", 0.0, 0.12),
        Knob("max_short_line_ratio", 1.0, 0.67),
        Knob("max_char_dup_ratio", 1.0, 0.01),
    )

    def __init__(self, params: FineWebParams | None = None):
        super().__init__(params)
        self._stops = tuple(self.params.terminal_punctuation)

    def process(self, doc: Doc) -> Doc | Drop:
        p: FineWebParams = self.params
        text = doc.text
        lines = [line for line in text.split("\n") if line and not line.isspace()]
        if not lines:
            return self.drop("empty")
        n = len(lines)
        if p.min_line_punct_ratio is not None:
            stops = self._stops
            ended = sum(1 for line in lines if line.rstrip().endswith(stops))
            if ended / n < p.min_line_punct_ratio:
                return self.drop("line_punct_ratio", value=ended / n, threshold=p.min_line_punct_ratio)
        if p.max_short_line_ratio is not None:
            limit = p.short_line_length
            short = sum(1 for line in lines if len(line) <= limit)
            if short / n > p.max_short_line_ratio:
                return self.drop("short_line_ratio", value=short / n, threshold=p.max_short_line_ratio)
        if p.max_char_dup_ratio is not None:
            ratio = _duplicates(lines)[1] / max(1, len(text) - text.count("\n"))
            if ratio > p.max_char_dup_ratio:
                return self.drop("char_dup_ratio", value=ratio, threshold=p.max_char_dup_ratio)
        if p.max_newline_word_ratio is not None:
            ratio = text.count("\n") / len(text.split())  # at least one word: there is a non-blank line
            if ratio > p.max_newline_word_ratio:
                return self.drop("list_ratio", value=ratio, threshold=p.max_newline_word_ratio)
        return doc


# ---------------------------------------------------------------------------------------------------
# Source code


_BASE64_RUN = re.compile(r"[A-Za-z0-9+/]{64,}={0,2}")
_HEX_RUN = re.compile(r"(?:(?:0x|\\x)?[0-9A-Fa-f]{2}[,\s]*){32,}")
_UNICODE_ESCAPES = re.compile(r"(?:\\u[0-9A-Fa-f]{4}){12,}")


class CodeQualityParams(StageParams):
    """Rules fit for source code, after the filters used to build code corpora: Codex (Chen et al.
    2021: files with a mean line length above 100, a longest line above 1,000 characters or few
    alphanumeric characters removed), The Stack / StarCoder (Kocetkov et al. 2022; Li et al. 2023: the
    same three with an alphanumeric fraction of at least 0.25, auto-generated files detected by
    keywords in their first lines, files made mostly of encoded data removed).

    Defaults: longest line 1,000; mean line length 100; alphanumeric fraction 0.25; the markers
    "auto-generated", "autogenerated", "automatically generated", "code generated by", "do not edit"
    looked for (case-insensitive) in the first 5 lines; encoded data (base64 runs of 64+ characters, hex
    byte runs of 32+ bytes, 12+ consecutive ``\\uXXXX`` escapes) at most half the characters.
    """

    max_line_length: int | None = Field(1000, description="Longest line (Codex, StarCoder: 1000).")
    max_mean_line_length: float | None = Field(100.0, description="Mean line length (Codex, StarCoder: 100).")
    min_alnum_fraction: float | None = Field(
        0.25, description="Smallest fraction of alphanumeric characters (StarCoder: 0.25)."
    )
    autogenerated_markers: list[str] = Field(
        ["auto-generated", "autogenerated", "automatically generated", "code generated by", "do not edit"],
        description="Phrases (case-insensitive) that mark a generated file when found in its first lines.",
    )
    autogenerated_lines: int = Field(5, description="How many first lines to search for the markers (5).")
    max_encoded_fraction: float | None = Field(
        0.5, description="Largest fraction of characters in encoded data (StarCoder: 0.5)."
    )


class CodeQuality(DocStage):
    """Drops minified, generated and data-blob files while keeping ordinary source code."""

    name = "code_quality"
    Params = CodeQualityParams
    filters = True
    # strict end: Codex / StarCoder's values
    strictness = (
        Knob("max_line_length", 100_000, 1000, integer=True),
        Knob("max_mean_line_length", 10_000.0, 100.0),
        Knob("min_alnum_fraction", 0.0, 0.25),
        Knob("max_encoded_fraction", 1.0, 0.5),
    )

    def __init__(self, params: CodeQualityParams | None = None):
        super().__init__(params)
        markers = "|".join(re.escape(m.lower()) for m in self.params.autogenerated_markers)
        self._markers = re.compile(markers) if markers else None

    def process(self, doc: Doc) -> Doc | Drop:
        p: CodeQualityParams = self.params
        text = doc.text
        if not text.strip():
            return self.drop("empty")
        lines = text.splitlines()
        if p.max_line_length is not None:
            longest = max(map(len, lines))
            if longest > p.max_line_length:
                return self.drop("max_line_length", value=longest, threshold=p.max_line_length)
        if p.max_mean_line_length is not None:
            mean = len(text) / len(lines)
            if mean > p.max_mean_line_length:
                return self.drop("mean_line_length", value=mean, threshold=p.max_mean_line_length)
        if self._markers is not None and p.autogenerated_lines > 0:
            head = "\n".join(lines[: p.autogenerated_lines]).lower()
            marker = self._markers.search(head)
            if marker is not None:
                return self.drop("autogenerated", value=marker.group(), threshold=p.autogenerated_lines)
        if p.min_alnum_fraction is not None:
            # str.isalnum per character in C: count of non-alphanumerics via translate would need a
            # table of all of Unicode; a regex over the complement is the fast path here.
            alnum = len(text) - sum(map(len, _NON_ALNUM.findall(text)))
            if alnum / len(text) < p.min_alnum_fraction:
                return self.drop("alnum_fraction", value=alnum / len(text), threshold=p.min_alnum_fraction)
        if p.max_encoded_fraction is not None:
            encoded = sum(
                sum(map(len, pattern.findall(text))) for pattern in (_BASE64_RUN, _HEX_RUN, _UNICODE_ESCAPES)
            )
            if encoded / len(text) > p.max_encoded_fraction:
                frac = encoded / len(text)
                return self.drop("encoded_data", value=frac, threshold=p.max_encoded_fraction)
        return doc


_NON_ALNUM = re.compile(r"[\W_]+")
