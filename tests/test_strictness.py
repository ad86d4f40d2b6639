"""Strictness levels: how ``lmforge data sweep`` moves a recipe's thresholds from lenient to strict."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.stages.registry import STAGES, stage_class
from lmforge.corpus.strictness import config_at, knob_table, spec_at
from lmforge.corpus.sweep import distinct_ngrams, distinct_ngrams_in, parse_levels, vocab_entropy, words_of
from lmforge.errors import ConfigError

NEEDS = {"classifier": "model", "perplexity": "run"}  # stages whose Params need a path


# Tolerances: every pytest.approx here keeps its default (1e-6 relative). Levels, knob values and entropies
# are float64 arithmetic on Python numbers, the same on every CPU: the default only absorbs the rounding of a
# formula written in another order (~1e-16 relative).


def _recipe(*stages: dict) -> object:
    return build_pipeline_config({"sources": [{"path": "builtin:pystdlib"}], "stages": list(stages)})


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_knob_names_a_parameter_and_validates_at_every_level(name):
    cls = stage_class(name)
    for knob in cls.strictness:
        assert knob.param in cls.Params.model_fields, f"{name}: knob {knob.param} is not a parameter"
    if cls.strictness:
        assert cls.filters, f"{name} has knobs but does not declare filters = True"
    spec = _recipe({"name": name}).stages[0] if name not in NEEDS else None
    if spec is None:
        return
    for level in range(0, 101, 5):
        at = spec_at(spec, level)
        if level == 0 and cls.filters:
            assert at is None
        else:
            cls.Params.model_validate(at.params)


def test_level_zero_runs_only_stages_that_change_text():
    cfg = _recipe({"name": "normalize"}, {"name": "gopher_quality"}, {"name": "pii"}, {"name": "dedup_exact"})
    assert [s.name for s in config_at(cfg, 0).stages] == ["normalize", "pii"]
    assert [s.name for s in config_at(cfg, 1).stages] == ["normalize", "gopher_quality", "pii", "dedup_exact"]


def test_level_100_is_the_published_setting_and_levels_interpolate():
    spec = _recipe({"name": "gopher_quality", "max_hash_ratio": 0.05}).stages[0]
    strict = stage_class("gopher_quality").Params.model_validate(spec_at(spec, 100).params)
    default = stage_class("gopher_quality").Params()
    assert strict.min_words == default.min_words == 50
    # approx default rel 1e-6 on float64 knob values: see the Tolerances note at the top
    assert strict.min_alpha_words == pytest.approx(default.min_alpha_words)
    assert strict.max_hash_ratio == pytest.approx(0.1)  # the knob moves the recipe's own value too
    half = spec_at(spec, 50).params
    assert half["min_words"] == 25
    assert half["max_mean_word_length"] == pytest.approx(55.0)  # 100 + (10 - 100) / 2
    assert half["min_alpha_words"] == pytest.approx(0.4)


def test_a_rule_the_recipe_turned_off_stays_off():
    spec = _recipe({"name": "fineweb", "max_char_dup_ratio": None}).stages[0]
    for level in (10, 100):
        params = spec_at(spec, level).params
        assert params["max_char_dup_ratio"] is None
        # approx default rel 1e-6: a float64 interpolation against its hand formula (Tolerances note, top)
        assert params["min_line_punct_ratio"] == pytest.approx(0.12 * level / 100)


def test_knob_table_lists_values_per_level():
    cfg = _recipe({"name": "langid"}, {"name": "normalize"})
    table = knob_table(cfg, [0, 50, 100])
    assert list(table) == ["langid"]
    # approx default rel 1e-6: float64 interpolations, see the Tolerances note at the top
    assert table["langid"]["min_score"] == [None, pytest.approx(0.325), pytest.approx(0.65)]


def test_levels_are_checked():
    assert parse_levels("100, 0,50,50") == [0.0, 50.0, 100.0]
    for bad in ("", "a,b", "-1", "101"):
        with pytest.raises(ConfigError, match="--levels"):
            parse_levels(bad)
    with pytest.raises(ConfigError):
        config_at(_recipe({"name": "langid"}), 120)


def test_diversity_and_entropy_measures():
    words = words_of("The cat sat. The cat ran, the DOG sat!")
    assert words == ["the", "cat", "sat", "the", "cat", "ran", "the", "dog", "sat"]
    assert distinct_ngrams(words, 1) == 5
    assert (
        distinct_ngrams(words, 2) == 7
    )  # the cat (twice), cat sat, sat the, cat ran, ran the, the dog, dog sat
    docs = [["a", "b", "a", "b"], ["a", "b", "c"]]
    assert distinct_ngrams_in(docs, 2) == (3, 7)  # ab, ba, bc: n-grams do not cross documents
    assert distinct_ngrams_in(docs, 2, limit=5) == (2, 5)  # the second document is cut after "a"
    assert vocab_entropy(Counter({w: 3 for w in "abcdefgh"})) == pytest.approx(3.0)
    assert vocab_entropy(Counter({"a": 1})) == 0.0
    p = [0.75, 0.25]
    # approx default rel 1e-6: a float64 entropy against its hand formula (Tolerances note at the top)
    assert vocab_entropy(Counter({"x": 3, "y": 1})) == pytest.approx(-sum(q * math.log2(q) for q in p))


def test_tables_move_entry_by_entry_and_on_off_rules_switch_at_50():
    rep = _recipe({"name": "gopher_repetition"}).stages[0]
    # approx default rel 1e-6: float64 interpolated table entries, see the Tolerances note at the top
    assert spec_at(rep, 50).params["top_ngram_char_frac"] == {
        2: pytest.approx(0.6),
        3: pytest.approx(0.59),
        4: pytest.approx(0.58),
    }
    # approx default rel 1e-6: a float64 knob value, see the Tolerances note at the top
    assert spec_at(rep, 100).params["dup_ngram_char_frac"][10] == pytest.approx(0.10)
    c4 = _recipe({"name": "c4", "filter_no_terminal_punct": False}).stages[0]
    assert spec_at(c4, 49).params["filter_curly_bracket"] is False
    assert spec_at(c4, 50).params["filter_curly_bracket"] is True
    assert spec_at(c4, 100).params["filter_no_terminal_punct"] is False  # the recipe turned it off
