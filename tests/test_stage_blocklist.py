"""The ``blocklist`` stage on hand-made pages: whole words not substrings, any case, phrases across line
breaks, the match count against ``max_matches``, a custom list file, and bad list files as one-line
configuration errors."""

from __future__ import annotations

import pytest

from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.blocklist import Blocklist, BlocklistParams
from lmforge.corpus.stages.blocklist_words import DEFAULT_WORDS
from lmforge.corpus.stages.registry import stage_class
from lmforge.errors import ConfigError


def _stage(tmp_path, lines: str, **kw) -> Blocklist:
    path = tmp_path / "words.txt"
    path.write_text(lines, encoding="utf-8")
    return Blocklist(BlocklistParams(words_file=str(path), use_default_list=False, **kw))


def _run(stage: Blocklist, text: str) -> Doc | Drop:
    return stage.process(Doc("d", text, "default"))


def test_whole_words_any_case_not_substrings(tmp_path):
    stage = _stage(tmp_path, "grape\n")
    for text in ("Grapes and grapefruit.", "a grape_vine", "grape2", "agrape"):
        out = _run(stage, text)
        assert isinstance(out, Doc) and out.meta["blocklist_matches"] == 0, text
    for text in ("GRAPE!", "one grape.", "(Grape)", "grape-juice", "é grape"):
        out = _run(stage, text)
        assert isinstance(out, Drop) and out.reason == "blocklist.listed_word", text
        assert out.value == "grape" and out.threshold == 0
    # entries with other characters than letters and digits go through the regex, same rules
    starred = _stage(tmp_path, "Gr*pe\n")
    assert isinstance(_run(starred, "a GR*PE."), Drop) and isinstance(_run(starred, "agr*pe grape"), Doc)


def test_phrases_match_across_whitespace_and_line_breaks(tmp_path):
    stage = _stage(tmp_path, "# fruit\n\n  Red   Apple \nsour cherry pie\n")
    assert isinstance(_run(stage, "a red\n  apple here"), Drop)
    out = _run(stage, "SOUR\tCHERRY\r\npie")
    assert isinstance(out, Drop) and out.value == "sour cherry pie"
    kept = _run(stage, "a red applesauce, a sour cherry, red, apple")
    assert isinstance(kept, Doc) and kept.meta["blocklist_matches"] == 0


def test_count_against_max_matches_and_first_match_reported(tmp_path):
    stage = _stage(tmp_path, "kiwi\nlime\nblood orange\n", max_matches=2, meta_key="bad")
    kept = _run(stage, "lime, Kiwi. nothing else")
    assert isinstance(kept, Doc) and kept.meta["bad"] == 2
    out = _run(stage, "a blood\norange, then kiwi, then lime")
    assert isinstance(out, Drop) and out.value == "blood orange" and out.threshold == 2
    # a listed word inside a matched phrase is counted once
    overlap = _stage(tmp_path, "orange\nblood orange\n", max_matches=1)
    assert isinstance(_run(overlap, "blood orange"), Doc)
    assert _run(overlap, "blood orange").meta["blocklist_matches"] == 1
    assert [e for _, e in overlap.matches("orange juice, blood orange")] == ["orange", "blood orange"]


def test_default_list_and_custom_file_together(tmp_path):
    default = Blocklist()
    assert 30 <= len(DEFAULT_WORDS) <= 100
    assert isinstance(default.process(Doc("d", "Click here for free PORN videos", "x")), Drop)
    clean = "The river carries sediment to the delta. Deep Throat was an FBI informant; XXX: fix later."
    assert isinstance(default.process(Doc("d", clean, "x")), Doc)
    both = Blocklist(BlocklistParams(words_file=str(_write(tmp_path, "delta\n"))))
    out = both.process(Doc("d", clean, "x"))
    assert isinstance(out, Drop) and out.value == "delta"


def _write(tmp_path, text: str):
    path = tmp_path / "custom.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_bad_list_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"blocklist\.words_file: .*none\.txt does not exist"):
        Blocklist(BlocklistParams(words_file=str(tmp_path / "none.txt")))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"blocklist\.words_file: .*latin1\.txt is not readable UTF-8"):
        Blocklist(BlocklistParams(words_file=str(tmp_path / "latin1.txt")))
    with pytest.raises(ConfigError, match=r"blocklist\.words_file: the list is empty"):
        _stage(tmp_path, "# only a comment\n\n")
    with pytest.raises(
        ConfigError, match=r"stages\[0\]\.max_matches: blocklist: .*greater than or equal to 0"
    ):
        build_pipeline_config(
            {"sources": [{"path": "x"}], "stages": [{"name": "blocklist", "max_matches": -1}]}
        )


def test_registered_with_an_integer_strictness_knob():
    cls = stage_class("blocklist")
    assert cls is Blocklist and cls.filters
    (knob,) = cls.strictness
    assert [knob.value(level) for level in (1, 50, 95, 100)] == [10, 5, 0, 0]
    assert knob.param == "max_matches"
