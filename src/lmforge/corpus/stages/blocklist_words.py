"""The ``blocklist`` stage's default list: a small set of obscene, sexually explicit and slur terms.

Written for lmforge; it is NOT C4's list (C4 used the "List of Dirty, Naughty, Obscene, and Otherwise
Bad Words", which is not shipped here) and it is not exhaustive: it covers English only and a few dozen
terms that are hard to read innocently in ordinary prose, technical text or code. Words with common
harmless senses ("bitch" and "coon" for animals, "dyke" for a dam, "fag" for a cigarette, "chink" for
a gap, "tranny" for a gearbox, "retarded" in physics, "xxx" in code comments, "sex", "hell", "screw")
are left out on purpose: a word list removes every page that uses such a word, and C4's list removed
text by and about minority groups disproportionately (Dodge et al. 2021, "Documenting Large Webtext
Corpora: A Case Study on the Colossal Clean Crawled Corpus"). For real filtering, give your own list with ``words_file``.
Entries are lower-case; a phrase's words are separated by single spaces (they match across any
whitespace, line breaks included).
"""

from __future__ import annotations

DEFAULT_WORDS: tuple[str, ...] = (
    # obscenities
    "fuck", "fucked", "fucker", "fuckers", "fucking", "motherfucker", "motherfuckers", "motherfucking",
    "shit", "shitty", "bullshit", "cunt", "cunts", "asshole", "assholes", "dickhead",
    "wanker", "twat", "cocksucker", "blowjob", "handjob", "jerk off",
    # sexually explicit
    "porn", "porno", "pornographic", "hardcore sex", "anal sex", "gangbang", "cumshot", "creampie",
    "deepthroat", "milf", "hentai", "nude teens", "camgirl",
    # slurs
    "nigger", "niggers", "nigga", "faggot", "faggots", "kike", "kikes", "wetback", "wetbacks", "raghead",
    "towelhead", "gook", "gooks",
    # threats
    "kill yourself",
)  # fmt: skip
