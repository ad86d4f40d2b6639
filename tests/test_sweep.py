"""``lmforge data sweep``: a recipe from lenient to strict through the real pipeline, measured."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.corpus.quality_model import train_quality_model
from lmforge.corpus.sweep import optimum

STORY = (
    "the river carried a stone past the old mill and the children of the town watched it with wonder "
    "because nobody had seen the water so high in that season of the year when snow melts slowly"
)
WORDS = STORY.split()


# Tolerances: every pytest.approx here keeps its default (1e-6 relative): both sides are float64 arithmetic on
# Python numbers (shares of counted documents, mean scores), the same on every CPU; the default only absorbs
# the rounding of another order of operations (~1e-16 relative).


def _prose(rng: random.Random, sentences: int) -> str:
    """Sentences of random words from one small vocabulary, with stop words and full stops."""
    out = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
        out.append(" ".join(words).capitalize() + ".")
    return "\n".join(" ".join(out[i : i + 3]) for i in range(0, len(out), 3))


def _junk(rng: random.Random) -> str:
    """Menu-like pages: short lines without punctuation, the same lines repeated."""
    lines = [f"item {rng.randint(0, 9)}" for _ in range(6)]
    return "\n".join(lines * 4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """A recipe over 30 prose pages, 10 junk pages and 5 exact copies, and a classifier of prose vs junk."""
    root = tmp_path_factory.mktemp("sweep")
    rng = random.Random(0)
    docs = [_prose(rng, rng.randint(6, 14)) for _ in range(30)] + [_junk(rng) for _ in range(10)]
    docs += docs[:5]
    with (root / "pages.jsonl").open("w") as fh:
        for i, text in enumerate(docs):
            fh.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
    model, _ = train_quality_model(
        [_prose(rng, 8) for _ in range(40)], [_junk(rng) for _ in range(40)], seed=0
    )
    model.save(root / "quality.npz")
    (root / "recipe.toml").write_text(
        f'[[sources]]\npath = "{root / "pages.jsonl"}"\n\n'
        '[[stages]]\nname = "normalize"\n\n'
        '[[stages]]\nname = "fineweb"\n\n'
        '[[stages]]\nname = "gopher_repetition"\n\n'
        '[[stages]]\nname = "dedup_exact"\n\n'
        "[tokenize]\nvocab_size = 300\n"
    )
    return root / "recipe.toml", root / "quality.npz"


def test_sweep_measures_size_quality_and_diversity_per_level(corpus, tmp_path, capsys):
    recipe, model = corpus
    out = tmp_path / "sweep"
    args = ["data", "sweep", "--config", str(recipe), "--out", str(out), "--levels", "0,50,100"]
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--reference-classifier", str(model), "--workers", "1"])
    assert exit_.value.code == 0
    result = json.loads((out / "sweep.json").read_text())
    assert (out / "sweep.png").stat().st_size > 10_000
    rows = {r["level"]: r for r in result["rows"]}
    assert rows[0]["documents"] == rows[0]["documents_input"] == 45  # level 0: nothing filtered
    assert rows[0]["removed"] == {}
    assert rows[100]["documents"] == 30  # junk and copies gone, every prose page kept
    assert rows[100]["removed"]["dedup_exact.duplicate"] == 5
    assert rows[0]["documents"] >= rows[50]["documents"] >= rows[100]["documents"]
    assert rows[0]["tokens"] > rows[100]["tokens"] > 0
    assert rows[100]["quality_mean"] > rows[0]["quality_mean"]  # the classifier likes what is left
    # the copies repeat n-grams and junk pages repeat lines: the strict corpus says more per token
    assert rows[100]["distinct_ngrams_per_token"] > rows[0]["distinct_ngrams_per_token"]
    assert result["k_words"] == rows[100]["words"]  # the fixed-size sample is the smallest level's size
    # approx default rel 1e-6 on float64 knob values: see the Tolerances note at the top
    assert result["knobs"]["fineweb"]["min_line_punct_ratio"] == [
        None,
        pytest.approx(0.06),
        pytest.approx(0.12),
    ]
    assert result["reference"] == {"kind": "classifier", "path": str(model), "higher_is_better": True}
    assert Path(result["tokenizer"]) == out / "tokenizer.json"
    for level in ("level-000", "level-050", "level-100"):  # each level is a complete lmforge data run
        assert (out / level / "report.json").is_file()
    # the marked optimum: the rule's best level with equal weights, also marked in the printed table
    best = optimum(result["rows"], True)
    assert result["optimum"]["level"] == result["rows"][best["index"]]["level"] == 50
    assert result["optimum"]["score"] == max(s for s in best["score"] if s is not None)
    table = capsys.readouterr().out
    assert [line.split()[0] for line in table.splitlines() if line.endswith("<- optimum")] == ["50"]


def test_optimum_weighs_size_quality_and_diversity_scaled_across_levels():
    rows = [
        {"level": 0, "tokens": 100, "quality_mean": 0.5, "distinct_ngrams_at_k": 0.2},
        {"level": 50, "tokens": 80, "quality_mean": 0.9, "distinct_ngrams_at_k": 0.3},
        {"level": 100, "tokens": 20, "quality_mean": 1.0, "distinct_ngrams_at_k": 0.3},
    ]
    best = optimum(rows, higher_is_better=True)
    assert best["size"] == [1.0, 0.75, 0.0] and best["quality"] == [0.0, 0.8, 1.0]
    # approx default rel 1e-6 on a float64 mean: see the Tolerances note at the top
    assert best["score"][1] == pytest.approx((0.75 + 0.8 + 1.0) / 3) and best["index"] == 1
    assert optimum(rows, True, (1, 0, 0))["index"] == 0  # size alone: keep everything
    assert optimum(rows, False, (0, 1, 0))["index"] == 0  # perplexity: lower is better
    rows[2]["quality_mean"] = None  # a level that kept nothing has no score
    assert optimum(rows, True)["score"][2] is None


def test_sweep_without_a_quality_reference_stops_before_any_work(corpus, tmp_path, capsys):
    recipe, _ = corpus
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as exit_:
        main(["data", "sweep", "--config", str(recipe), "--out", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--reference-classifier" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "data",
                "sweep",
                "--config",
                str(recipe),
                "--out",
                str(out),
                "--reference-classifier",
                str(tmp_path / "no.npz"),
            ]
        )
    assert exit_.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_:
        main(["data", "sweep", "--config", str(recipe), "--out", str(out), "--levels", "0,150"])
    assert exit_.value.code == 2
    assert "--levels" in capsys.readouterr().err
