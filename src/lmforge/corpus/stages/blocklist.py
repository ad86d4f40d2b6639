"""``blocklist``: remove pages that contain listed words or phrases (C4's bad-words rule, with a count).

C4 (Raffel et al. 2020, section 2.2) removed every page holding any word of the "List of Dirty,
Naughty, Obscene, and Otherwise Bad Words". This stage applies that rule with a list given as a file
(``words_file``: UTF-8, one word or phrase a line, blank lines and lines starting with ``#`` ignored)
and/or the small default list of :mod:`lmforge.corpus.stages.blocklist_words` (written for lmforge, not
C4's list, not exhaustive). Matching is case-insensitive and whole-word: an entry matches where no
letter, digit or underscore touches it on either side ("porn" matches "Porn!" but not "pornstar"
unless listed); a phrase's words match across any whitespace, line breaks included. Occurrences are
counted without overlap (a single word inside a matched phrase is not counted again).

A page is removed when its number of matches is above ``max_matches``: 0 is C4's rule (any match).
Kept pages get the count in ``meta[meta_key]``. Removal: ``blocklist.listed_word`` (``value`` the first
matched entry, as listed; ``threshold`` ``max_matches``).

**Strictness.** ``max_matches`` moves from 10 (lenient: only pages with more than ten matches go) to
0 (strict: C4's rule, any match).

Speed: the page is lower-cased and cut into ``\\w+`` tokens once; a page whose token set meets neither
the single-word entries nor the first words of the phrases is kept at once (linear in the page,
whatever the list's length). Otherwise the words found and the phrases (and entries with other
characters) are located by compiled regex alternations.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, Knob, StageParams
from lmforge.corpus.stages.blocklist_words import DEFAULT_WORDS
from lmforge.errors import ConfigError

_TOKEN = re.compile(r"\w+")
_WORD = re.compile(r"\w+\Z")


@functools.lru_cache(maxsize=1024)
def _alternation(words: frozenset[str]) -> re.Pattern[str]:
    """A regex finding any of ``words`` (made of word characters) as whole words."""
    return re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, sorted(words))) + r")(?!\w)")


class BlocklistParams(StageParams):
    """The list (a file and/or the built-in default) and how many matches a kept page may hold."""

    words_file: str | None = Field(
        None, description="UTF-8 file, one word or phrase a line, '#' starts a comment line (unset: none)"
    )
    use_default_list: bool = Field(
        True,
        description="also use lmforge's small default list (blocklist_words.py; not C4's, not exhaustive)",
    )
    max_matches: int = Field(
        0, ge=0, description="a page with more matches than this is removed (0: any match, C4's rule)"
    )
    meta_key: str = Field("blocklist_matches", min_length=1, description="meta key of a kept page's count")


def normalise(entry: str) -> str:
    """An entry as matched: lower-cased, its words separated by single spaces."""
    return " ".join(entry.lower().split())


def read_words_file(path: str) -> list[str]:
    """The entries of a list file; ConfigError naming ``blocklist.words_file`` if unreadable."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"blocklist.words_file: {path} does not exist; give a UTF-8 file, one word a line")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"blocklist.words_file: {path} is not readable UTF-8 text ({exc})") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


class Blocklist(DocStage):
    """Counts listed words and phrases in each page; removes pages with more than ``max_matches``."""

    name: ClassVar[str] = "blocklist"
    Params: ClassVar[type[StageParams]] = BlocklistParams
    filters: ClassVar[bool] = True
    strictness: ClassVar[tuple[Knob, ...]] = (Knob("max_matches", 10, 0, integer=True),)

    def __init__(self, params: BlocklistParams | None = None):
        super().__init__(params)
        p: BlocklistParams = self.params
        entries = list(DEFAULT_WORDS) if p.use_default_list else []
        if p.words_file is not None:
            entries += read_words_file(p.words_file)
        listed = {normalise(e): e for e in reversed(entries) if normalise(e)}  # first spelling wins
        if not listed:
            raise ConfigError(
                "blocklist.words_file: the list is empty; give a words_file with entries "
                "or set use_default_list = true"
            )
        self._words = {k: v for k, v in listed.items() if _WORD.match(k)}
        others = sorted((k for k in listed if k not in self._words), key=len, reverse=True)
        self._listed = listed
        self._phrases = (
            re.compile(
                r"(?<!\w)(?:" + "|".join(r"\s+".join(map(re.escape, k.split())) for k in others) + r")(?!\w)"
            )
            if others
            else None
        )
        # a phrase can only match where its first word is a token (unless that word has other characters)
        firsts = [k.split()[0] for k in others]
        self._phrase_firsts = frozenset(firsts) if all(_WORD.match(f) for f in firsts) else None

    def matches(self, text: str) -> list[tuple[int, str]]:
        """``(offset, entry as listed)`` of every match in ``text``, in text order, without overlaps.

        Matching is on ``text.lower()`` (offsets are into it). Most pages hold no listed word: the set of
        their tokens is checked first, and positions are looked for only when it meets the list.
        """
        lower = text.lower()
        tokens = set(_TOKEN.findall(lower))
        phrases = self._phrases is not None and (
            self._phrase_firsts is None or not self._phrase_firsts.isdisjoint(tokens)
        )
        hits = self._words.keys() & tokens
        if not phrases and not hits:
            return []
        found: list[tuple[int, str]] = []
        spans: list[tuple[int, int]] = []
        if phrases:
            for m in self._phrases.finditer(lower):
                key = normalise(m.group())
                found.append((m.start(), self._listed.get(key, key)))
                spans.append(m.span())
        if hits:
            for m in _alternation(frozenset(hits)).finditer(lower):
                if not any(a <= m.start() < b for a, b in spans):
                    found.append((m.start(), self._words[m.group()]))
        found.sort()
        return found

    def process(self, doc: Doc) -> Doc | Drop:
        p: BlocklistParams = self.params
        found = self.matches(doc.text)
        if len(found) > p.max_matches:
            return self.drop("listed_word", value=found[0][1], threshold=p.max_matches)
        return replace(doc, meta={**doc.meta, p.meta_key: len(found)})
