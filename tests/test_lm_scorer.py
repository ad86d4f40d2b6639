"""``LMScorer``: a document's mean token loss under a run's model, as training sees documents (end-of-text
first), in windows when longer than the context; checked against the model called by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.corpus.lm_scorer import LMScorer, windows
from lmforge.errors import ConfigError
from lmforge.evaluate.run_loading import load_run
from tests.conftest import training_texts

SEQ = 32  # tiny_overrides' data.seq_len


@pytest.fixture(autouse=True)
def _threads():
    """One thread: these models are tiny, and a second thread only waits on a shared machine."""
    torch.set_num_threads(1)


@pytest.fixture
def run(scorer_run) -> Path:
    return scorer_run


@pytest.fixture(scope="module")
def texts(corpus_dir) -> list[str]:
    """Other text than the run learned: standard-library modules."""
    lines = (corpus_dir / "stdlib.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines]


def direct_losses(run: Path, seq: list[int], context: int, stride: int) -> float:
    """Mean over targets ``j = 1 .. n-1`` of ``-log p(t_j | t_s .. t_{j-1})``, one forward pass per target,
    with ``s`` the start of the window that scores ``j``: 0 while ``j <= context``, else the window ending
    at ``min(n, context + 1 + stride * ceil((j + 1 - context - 1) / stride))``."""
    _, _, model, _ = load_run(run, torch.device("cpu"))
    n, total = len(seq), 0.0
    with torch.inference_mode():
        for j in range(1, n):
            if j <= context:
                s = 0
            else:
                end = min(n, context + 1 + stride * -(-(j + 1 - context - 1) // stride))
                s = end - context - 1
            x = torch.tensor([seq[s:j]])
            logits = model.logits(model(x))[0, -1]
            total += F.cross_entropy(logits[None], torch.tensor([seq[j]])).item()
    return total / (n - 1)


def test_windows_count_every_target_once_with_context():
    assert windows(10, 4, 2) == [(0, 5, 1), (2, 7, 5), (4, 9, 7), (5, 10, 9)]
    assert windows(5, 4, 2) == [(0, 5, 1)]  # fits one window
    assert windows(1, 4, 2) == [] and windows(0, 4, 2) == []
    for n, c, stride in [(2, 4, 4), (100, 32, 16), (100, 32, 32), (97, 32, 1), (33, 32, 16), (34, 32, 16)]:
        counted = []
        for start, end, first in windows(n, c, stride):
            assert (end - start <= c + 1 and start < first < end) or (start, first) == (0, 1)
            counted += range(first, end)
            # each counted target sees at least C + 1 - stride tokens, or all before it
            assert all(j - start >= min(j, c + 1 - stride) for j in range(first, end))
        assert counted == list(range(1, n)), (n, c, stride)
    with pytest.raises(ValueError):
        windows(10, 4, 5)


def test_one_window_equals_the_model_by_hand_and_batching_changes_nothing(run, texts):
    scorer = LMScorer(run, batch_size=4)
    docs = [t for t in texts if 8 < len(scorer.token_ids([t])[0]) <= SEQ + 1][:6]
    seqs = scorer.token_ids(docs)
    assert all(len(s) <= SEQ + 1 for s in seqs) and len({len(s) for s in seqs}) > 1  # padding is exercised
    assert all(s[0] == scorer.token_ids([""])[0][0] for s in seqs)  # end-of-text first
    _, _, model, _ = load_run(run, torch.device("cpu"))
    with torch.inference_mode():
        want = [
            F.cross_entropy(model.logits(model(torch.tensor([s[:-1]])))[0], torch.tensor(s[1:])).item()
            for s in seqs
        ]
    got = scorer.losses(docs)
    assert got.dtype == np.float64
    # FP32 mean token losses of padded batches against one sequence at a time (sums of <= 90 terms in other
    # orders: 90 u = 5e-6 worst case, u = 2^-24): measured 1.4e-7 and 4e-9 relative
    np.testing.assert_allclose(got, want, rtol=1e-5)
    alone = np.array([scorer.losses([d])[0] for d in docs])
    # the same FP32 bound: padded batches of 4 against each document scored alone (see above)
    np.testing.assert_allclose(got, alone, rtol=1e-5)
    np.testing.assert_allclose(scorer.score(docs), np.exp(got), rtol=1e-12)  # float64 exp: measured equal


@pytest.mark.parametrize("stride", [None, SEQ, 5])
def test_long_document_in_windows_equals_one_forward_per_target(run, texts, stride):
    doc = next(t for t in texts if len(t) > 600)
    scorer = LMScorer(run, max_tokens=90, batch_size=3, stride=stride)
    seq = scorer.token_ids([doc])[0]
    assert len(seq) == 91  # end-of-text + max_tokens: several windows
    want = direct_losses(run, seq, SEQ, stride or SEQ // 2)
    # windows against one forward per target: FP32 sums of 90 terms (worst case 5e-6); measured 3.7e-8
    np.testing.assert_allclose(scorer.losses([doc])[0], want, rtol=1e-5)


def test_training_text_scores_lower_than_shuffled_characters_and_random_words(run):
    rng = random.Random(0)
    docs = training_texts()
    shuffled = ["".join(rng.sample(t, len(t))) for t in docs]
    vocab = sorted({w for t in docs for w in t.split()})  # the training text's own words, in random order
    words = [" ".join(rng.choice(vocab) for _ in range(len(t.split()))) for t in docs]
    scorer = LMScorer(run)
    real, chars, rand = scorer.score(docs), scorer.score(shuffled), scorer.score(words)
    assert (real < chars).all() and (real < rand).all(), (real, chars, rand)


def test_empty_and_truncated_documents(run, texts):
    scorer = LMScorer(run, max_tokens=7)
    out = scorer.losses(["", texts[0], texts[0][:10]])
    assert np.isnan(out[0]) and np.isfinite(out[1:]).all()
    assert [len(s) for s in scorer.token_ids(["", texts[0]])] == [1, 8]
    full = LMScorer(run).token_ids([texts[0]])[0]
    assert scorer.token_ids([texts[0]])[0] == full[:8]


def test_step_picks_the_checkpoint(run, texts):
    early, late = LMScorer(run, step=30), LMScorer(run)
    assert (early.step, late.step) == (30, 60)
    assert early.losses(texts[:3]).tolist() != late.losses(texts[:3]).tolist()


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("no_run", "run: "),
        ("no_checkpoint", "run: "),
        ("bad_step", "step: "),
        ("bad_stride", "stride: "),
    ],
)
def test_bad_run_folder_is_a_one_line_config_error(run, tmp_path, kind, says):
    target, kw = tmp_path, {}
    if kind == "no_checkpoint":
        (tmp_path / "config.toml").write_text((run / "config.toml").read_text())
    elif kind == "bad_step":
        target, kw = run, {"step": 7}
    elif kind == "bad_stride":
        target, kw = run, {"stride": SEQ + 1}
    with pytest.raises(ConfigError) as exc:
        LMScorer(target, **kw)
    assert str(exc.value).startswith(says) and "\n" not in str(exc.value), str(exc.value)
