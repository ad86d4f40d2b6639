"""The hashed n-gram quality model: it separates two kinds of text it has not seen, its formula is
sklearn's logistic regression, a saved model scores exactly as the trained one, and a bad file is a
one-line error naming it (never unpickled)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from lmforge.corpus.quality_model import (
    FeatureSpec,
    QualityModel,
    featurize,
    sigmoid,
    train_quality_model,
)
from lmforge.errors import DataError, UserError

PROSE = (
    "the river carries fine sediment toward the delta where it settles in layers over many centuries",
    "photosynthesis converts light energy into chemical energy stored in the bonds of glucose molecules",
    "the committee published its findings after reviewing the historical records of the city archive",
    "a prime number has exactly two divisors and every integer factors uniquely into primes",
    "the orchestra rehearsed the second movement slowly so that the strings could follow the conductor",
    "glaciers shaped the valley floor and left behind moraines that farmers later cleared for fields",
    "the author describes how medieval scribes copied manuscripts by hand in monastery libraries",
    "enzymes lower the activation energy of a reaction without being consumed by the reaction itself",
)
SPAM = (
    "BUY NOW!!! cheap pills best price click here limited offer free shipping",
    "win a free iphone click the link now hurry offer ends today $$$",
    "hot singles in your area click here to chat now free registration",
    "make money fast work from home earn $5000 a week no experience click",
    "cheap replica watches discount 90% off order now best deals online",
    "casino bonus free spins deposit now win big jackpot click here",
    "lose weight fast miracle pill doctors hate this one trick buy now",
    "SEO backlinks cheap guaranteed ranking buy 1000 links today best price",
)


def make_texts(kind: str, n: int, seed: int) -> list[str]:
    """``n`` documents of 3-6 sentences drawn from the PROSE or SPAM sentences, words shuffled a little."""
    rng = random.Random(seed)
    pool = PROSE if kind == "prose" else SPAM
    out = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(3, 6)):
            words = rng.choice(pool).split()
            i = rng.randrange(len(words) - 1)
            words[i], words[i + 1] = words[i + 1], words[i]
            sentences.append(" ".join(words) + ".")
        out.append(" ".join(sentences))
    return out


@pytest.fixture(scope="module")
def trained() -> tuple[QualityModel, dict]:
    return train_quality_model(make_texts("prose", 40, 0), make_texts("spam", 40, 1), seed=0)


def test_separates_unseen_documents_and_reports(trained):
    model, report = trained
    assert report["n_positive"] == 40 and report["n_negative"] == 40
    ho = report["held_out"]
    assert ho["n_test"] == 16 and ho["n_test_positive"] == 8
    assert ho["accuracy"] == 1.0 and ho["auc"] == 1.0
    assert report["train_seconds"] > 0 and report["nonzero_weights"] > 0
    good, bad = model.score(make_texts("prose", 20, 7)), model.score(make_texts("spam", 20, 8))
    assert good.dtype == np.float64 and good.shape == (20,)
    assert good.min() > 0.5 > bad.max()
    assert np.all((good >= 0) & (good <= 1)) and np.all((bad >= 0) & (bad <= 1))
    assert model.score([]).shape == (0,)


def test_score_is_sklearn_logistic_regression():
    """sigmoid(x . w + b) computed here equals sklearn's predict_proba of the same fit."""
    from sklearn.linear_model import LogisticRegression

    pos, neg = make_texts("prose", 12, 3), make_texts("spam", 9, 4)
    model, report = train_quality_model(pos, neg, seed=5)
    assert report["held_out"] is None or report["held_out"]["n_test"] > 0
    spec = FeatureSpec()
    clf = LogisticRegression(class_weight="balanced", max_iter=1000, random_state=5)
    clf.fit(featurize(pos + neg, spec), [1] * len(pos) + [0] * len(neg))
    new = make_texts("prose", 3, 9) + make_texts("spam", 3, 10) + ["", "café ünïcode"]
    want = clf.predict_proba(featurize(new, spec))[:, 1]
    # the same float64 logistic model scored by lmforge's code and scikit-learn's: measured 1.7e-16 relative
    # (float64 rounding of a dot product); 1e-9 is room for another summation order, far below a wrong feature
    np.testing.assert_allclose(model.score(new), want, rtol=1e-9, atol=1e-12)


def test_sigmoid_is_stable():
    z = np.array([-1000.0, -1.0, 0.0, 1.0, 1000.0])
    # assert_allclose's default rtol 1e-7 (atol 0): float64 formulas, rounding only; at -1000 exactly 0 (exp underflows)
    np.testing.assert_allclose(sigmoid(z), [0.0, 1 / (1 + np.e), 0.5, 1 / (1 + np.exp(-1)), 1.0])


def test_save_load_round_trip_is_exact(trained, tmp_path):
    model, _ = trained
    path = tmp_path / "q.npz"
    model.save(path)
    loaded = QualityModel.load(path)
    texts = make_texts("prose", 5, 11) + make_texts("spam", 5, 12)
    assert np.array_equal(loaded.score(texts), model.score(texts))
    assert loaded.spec == model.spec and loaded.intercept == model.intercept
    with np.load(path, allow_pickle=False) as z:  # the header is plain JSON
        header = json.loads(str(z["spec"][()]))
    assert header["format_version"] == 1 and header["features"]["word_ngrams"] == [1, 2]


def test_bad_files_are_one_line_errors_naming_the_path(trained, tmp_path):
    model, _ = trained
    with pytest.raises(DataError, match=r"missing\.npz: no such model file"):
        QualityModel.load(tmp_path / "missing.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip archive at all")
    with pytest.raises(DataError, match=r"junk\.npz: not a quality model file") as err:
        QualityModel.load(junk)
    assert "\n" not in str(err.value)
    # an archive holding a pickled object is refused, not unpickled
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, spec=np.array([{"kind": "x"}], dtype=object), indices=np.zeros(1), weights=np.zeros(1))
    with pytest.raises(DataError, match=r"pickled\.npz: not a quality model file"):
        QualityModel.load(pickled)
    # another lmforge format version
    model.save(tmp_path / "ok.npz")
    with np.load(tmp_path / "ok.npz") as z:
        arrays = dict(z)
    header = json.loads(str(arrays["spec"][()]))
    arrays["spec"] = np.array(json.dumps(header | {"format_version": 99}))
    np.savez(tmp_path / "v99.npz", **arrays)
    with pytest.raises(DataError, match=r"v99\.npz: quality model format 99"):
        QualityModel.load(tmp_path / "v99.npz")


def test_too_few_documents():
    with pytest.raises(UserError, match="1 positive and 3 negative"):
        train_quality_model(["one"], ["a", "b", "c"])
    _, report = train_quality_model(["a b", "c d"], ["e f", "g h"])
    assert report["held_out"] is None  # too few to hold any out
