"""A linear text classifier on hashed n-gram features: the model behind the ``classifier`` stage.

Features (:class:`FeatureSpec`): word 1-2-grams and character 3-5-grams inside word boundaries
(``char_wb``), each hashed by scikit-learn's stateless ``HashingVectorizer`` into ``2**hash_bits``
columns (``alternate_sign=False``, lower-cased, each block L2-normalised), the two blocks side by side.
Only the first ``max_chars`` characters of a document are read, in training and in scoring alike.
The model is logistic regression (``class_weight="balanced"``, L2 penalty ``C``, fixed seed):

    P(positive | x) = sigmoid(x . w + b) = 1 / (1 + exp(-(x . w + b)))

**File format** (``FORMAT_VERSION`` 1): one ``.npz`` archive holding ``spec`` (a JSON string: format
version, feature settings, labels), ``indices`` / ``weights`` (the non-zero entries of ``w``: features
never seen in training keep weight 0 under the L2 penalty) and ``intercept`` (``b``). Nothing in it is
pickled: :meth:`QualityModel.load` reads it with ``allow_pickle=False``, rebuilds the vectorizer from the
settings and computes the formula above itself, so loading a model file cannot run code.
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse

from lmforge.errors import DataError, UserError

FORMAT_VERSION = 1
KIND = "lmforge.quality_model"


@dataclass(frozen=True)
class FeatureSpec:
    """How a text becomes a feature vector (stateless: these settings are the whole vectorizer)."""

    word_ngrams: tuple[int, int] = (1, 2)
    char_ngrams: tuple[int, int] = (3, 5)
    hash_bits: int = 18
    max_chars: int = 10_000

    @property
    def n_features(self) -> int:
        """Columns of the feature matrix: a word block and a character block of ``2**hash_bits`` each."""
        return 2 * (1 << self.hash_bits)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, tree: dict[str, Any]) -> FeatureSpec:
        return cls(
            word_ngrams=(int(tree["word_ngrams"][0]), int(tree["word_ngrams"][1])),
            char_ngrams=(int(tree["char_ngrams"][0]), int(tree["char_ngrams"][1])),
            hash_bits=int(tree["hash_bits"]),
            max_chars=int(tree["max_chars"]),
        )


@functools.lru_cache(maxsize=4)
def _vectorizers(spec: FeatureSpec) -> tuple[Any, Any]:
    """The word and character ``HashingVectorizer`` of ``spec`` (stateless, so built once and shared)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    common = dict(n_features=1 << spec.hash_bits, alternate_sign=False, norm="l2", lowercase=True)
    words = HashingVectorizer(analyzer="word", ngram_range=spec.word_ngrams, **common)
    chars = HashingVectorizer(analyzer="char_wb", ngram_range=spec.char_ngrams, **common)
    return words, chars


def featurize(texts: list[str], spec: FeatureSpec) -> sparse.csr_matrix:
    """The ``len(texts) x spec.n_features`` feature matrix: [word block | char block], each row L2 per block."""
    words, chars = _vectorizers(spec)
    cut = [t[: spec.max_chars] for t in texts]
    return sparse.hstack([words.transform(cut), chars.transform(cut)], format="csr", dtype=np.float64)


def sigmoid(z: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-z))``, computed without overflow for large ``|z|``."""
    out = np.empty_like(z, dtype=np.float64)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


@dataclass
class QualityModel:
    """Weights ``w`` (dense, ``spec.n_features``) and bias ``b`` of ``P(positive) = sigmoid(x . w + b)``."""

    spec: FeatureSpec
    weights: np.ndarray
    intercept: float
    labels: dict[str, str] = field(default_factory=lambda: {"positive": "positive", "negative": "negative"})

    def decision(self, texts: list[str]) -> np.ndarray:
        """``x . w + b`` per text (float64)."""
        if not texts:
            return np.zeros(0, dtype=np.float64)
        return np.asarray(featurize(list(texts), self.spec) @ self.weights, dtype=np.float64) + self.intercept

    def score(self, texts: list[str]) -> np.ndarray:
        """P(positive) per text, in [0, 1] (float64)."""
        return sigmoid(self.decision(texts))

    def save(self, path: str | Path) -> None:
        """Write the model to ``path`` (one ``.npz``, no pickle), atomically."""
        path = Path(path)
        nz = np.flatnonzero(self.weights)
        header = {"kind": KIND, "format_version": FORMAT_VERSION, "features": self.spec.to_json()}
        header["labels"] = self.labels
        buf = io.BytesIO()
        np.savez_compressed(
            buf,
            spec=np.array(json.dumps(header)),
            indices=nz.astype(np.int64),
            weights=self.weights[nz].astype(np.float64),
            intercept=np.array(self.intercept, dtype=np.float64),
        )
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> QualityModel:
        """A model written by :meth:`save`; a missing or unreadable file is a DataError naming ``path``."""
        path = Path(path)
        if not path.is_file():
            raise DataError(
                f"{path}: no such model file; train one with lmforge data train-classifier --out {path}"
            )
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(str(z["spec"][()]))
                indices, values = z["indices"], z["weights"]
                intercept = float(z["intercept"][()])
        except Exception as exc:  # zip, numpy and JSON raise many types for a damaged file
            raise DataError(
                f"{path}: not a quality model file ({type(exc).__name__}); "
                "give a file written by lmforge data train-classifier"
            ) from None
        if not isinstance(header, dict) or header.get("kind") != KIND:
            raise DataError(
                f"{path}: not a quality model file; give a file written by lmforge data train-classifier"
            )
        if header.get("format_version") != FORMAT_VERSION:
            raise DataError(
                f"{path}: quality model format {header.get('format_version')!r}, this lmforge reads "
                f"{FORMAT_VERSION}; train it again with lmforge data train-classifier"
            )
        try:
            spec = FeatureSpec.from_json(header["features"])
            weights = np.zeros(spec.n_features, dtype=np.float64)
            weights[indices.astype(np.int64)] = values
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise DataError(f"{path}: damaged quality model ({exc}); train it again") from None
        if not math.isfinite(intercept) or not np.all(np.isfinite(weights)):
            raise DataError(f"{path}: damaged quality model (non-finite weights); train it again")
        return cls(spec, weights, intercept, dict(header.get("labels") or {}))


def _metrics(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """Accuracy at P = 0.5 and the ROC AUC of held-out labels ``y`` (1 = positive) and scores ``p``."""
    from sklearn.metrics import roc_auc_score

    return {"accuracy": float(np.mean((p >= 0.5) == (y == 1))), "auc": float(roc_auc_score(y, p))}


def _fit(x: sparse.csr_matrix, y: np.ndarray, c: float, seed: int) -> tuple[np.ndarray, float]:
    from sklearn.linear_model import LogisticRegression

    clf = LogisticRegression(C=c, class_weight="balanced", max_iter=1000, random_state=seed)
    clf.fit(x, y)
    return clf.coef_[0].astype(np.float64), float(clf.intercept_[0])


MIN_HELD_OUT = 5  # per class: fewer documents and the held-out split is skipped


def train_quality_model(
    positive: list[str],
    negative: list[str],
    *,
    spec: FeatureSpec | None = None,
    c: float = 1.0,
    held_out: float = 0.2,
    seed: int = 0,
    labels: dict[str, str] | None = None,
) -> tuple[QualityModel, dict[str, Any]]:
    """Fit P(positive) on the two lists; returns the model and a report.

    A seeded, stratified ``held_out`` share of each class is left out of a first fit and scored (the
    report's ``held_out``: ``accuracy`` at 0.5 and ``auc``; ``None`` when a class has fewer than
    ``MIN_HELD_OUT`` documents); the returned model is then fit on every document. UserError if a class
    has fewer than 2 documents.
    """
    if len(positive) < 2 or len(negative) < 2:
        raise UserError(
            f"train-classifier: {len(positive)} positive and {len(negative)} negative documents; "
            "each class needs at least 2 (give more files)"
        )
    if not 0.0 < held_out < 1.0:
        raise UserError(f"train-classifier: held_out must be in (0, 1), got {held_out}")
    spec = spec or FeatureSpec()
    texts = list(positive) + list(negative)
    y = np.array([1] * len(positive) + [0] * len(negative))
    start = time.perf_counter()
    x = featurize(texts, spec)
    report: dict[str, Any] = {
        "n_positive": len(positive),
        "n_negative": len(negative),
        "features": spec.to_json(),
        "C": c,
        "seed": seed,
        "held_out": None,
    }
    if min(len(positive), len(negative)) >= MIN_HELD_OUT:
        from sklearn.model_selection import train_test_split

        idx_train, idx_test = train_test_split(
            np.arange(len(y)), test_size=held_out, random_state=seed, stratify=y
        )
        w, b = _fit(x[idx_train], y[idx_train], c, seed)
        p = sigmoid(np.asarray(x[idx_test] @ w) + b)
        report["held_out"] = {
            "fraction": held_out,
            "n_train": len(idx_train),
            "n_test": len(idx_test),
            "n_test_positive": int(y[idx_test].sum()),
            **_metrics(y[idx_test], p),
        }
    w, b = _fit(x, y, c, seed)
    train_p = sigmoid(np.asarray(x @ w) + b)
    report["train_accuracy"] = float(np.mean((train_p >= 0.5) == (y == 1)))
    report["train_seconds"] = round(time.perf_counter() - start, 3)
    model = QualityModel(spec, w, b, labels or {"positive": "positive", "negative": "negative"})
    report["nonzero_weights"] = int(np.count_nonzero(w))
    return model, report
