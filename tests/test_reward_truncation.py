"""A reward model reads at most its run's ``data.seq_len`` ids, and a longer sequence is cut from the left
(``posttrain/reward_model_reward.py::keep_end``): the leading ``<|endoftext|>`` stays, the prompt's start
goes, and the last token, the one the reward head reads, is the completion's own end. A freshly
initialised tiny reward model (2 blocks, width 32, ``seq_len`` 32, FP32, init std 0.5 so that the hidden
state at the last token depends visibly on the tokens) over a byte-level BPE with the chat tokens; no
training is needed for either property."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.evaluate.reward import score, score_chats
from lmforge.posttrain.records import Turn
from lmforge.posttrain.reward import RewardModel
from lmforge.posttrain.reward_model_reward import RewardModelReward, RewardScorer, keep_end
from lmforge.posttrain.template import ChatTemplate, add_chat_tokens
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import EOT, Tokenizer, train_tokenizer
from tests.conftest import training_texts

SEQ_LEN = 32
PROMPT = "Describe bisect.insort."
# far over 32 tokens; the two completions differ only in their last word
BODY = "Insert item x in list a, and keep it sorted assuming a is sorted. " * 4
LONG = (
    BODY + "If x is already in a, insert it to the right.",
    BODY + "If x is already in a, insert it to the left.",
)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory) -> RewardScorer:
    root: Path = tmp_path_factory.mktemp("rm-trunc")
    train_tokenizer(training_texts(), 300, root / "plain.json")
    tok = add_chat_tokens(root / "plain.json", root / "tokenizer.json")
    torch.manual_seed(0)
    model = RewardModel(
        ModelConfig(n_layers=2, d_model=32, n_heads=4, init_std=0.5), tok.vocab_size, SEQ_LEN, "sdpa"
    )
    model.init_weights()
    with torch.no_grad():  # a head of unit scale, so rewards differ visibly (its init is std 0.02)
        model.score.weight.normal_(0.0, 1.0)
    model.eval().requires_grad_(False)
    return RewardScorer(
        model,
        Tokenizer(root / "tokenizer.json"),
        SEQ_LEN,
        PrecisionPolicy.resolve("fp32", torch.device("cpu")),
    )


def _direct(scorer: RewardScorer, ids: list[int]) -> float:
    """The reward model called on ``ids`` itself: one row, no padding, no cut."""
    with torch.no_grad():
        return scorer.model.rewards(torch.tensor([ids]), scorer.tokenizer.eot_id).double().item()


def test_keep_end_keeps_the_document_start_and_the_last_ids():
    """The rule by hand: a fitting sequence is unchanged; a longer one keeps its leading document start and
    its last ``seq_len - 1`` ids (its last ``seq_len`` when it does not start with the document start)."""
    assert keep_end([0, 5, 6], 3, 0) == [0, 5, 6]
    assert keep_end([0, 1, 2, 3, 4, 5], 3, 0) == [0, 4, 5]
    assert keep_end([7, 1, 2, 3, 4, 5], 3, 0) == [3, 4, 5]


@pytest.mark.parametrize("form", ["chat", "none"])
def test_long_completions_that_differ_at_their_ends_get_different_rewards(scorer, form):
    """Two completions of one prompt, longer than ``seq_len`` and equal but for their last word: their
    first ``seq_len`` ids are the same (so the old cut of the end scored both alike), the rows scored keep
    their different ends, and each reward is the model's on exactly ``<|endoftext|>`` + the sequence's last
    ``seq_len - 1`` ids. Both ``rl.template`` forms of ``rl.reward = "run:PATH"``, and ``score`` /
    ``score_chats`` of ``evaluate/reward.py``."""
    reward = RewardModelReward(scorer, form)
    if form == "chat":
        template = ChatTemplate(scorer.tokenizer)
        whole = [template.render((Turn("user", PROMPT), Turn("assistant", c)))[0] for c in LONG]
        api = score_chats(scorer, [(PROMPT, c) for c in LONG], batch_size=1)
    else:
        whole = [scorer.tokenizer.encode(f"{EOT}{PROMPT}{c}") for c in LONG]
        api = score(scorer, [f"{EOT}{PROMPT}{c}" for c in LONG], batch_size=1)
    assert all(len(w) > SEQ_LEN for w in whole)
    assert whole[0][:SEQ_LEN] == whole[1][:SEQ_LEN]  # what a cut of the end kept: the same ids for both
    rows = reward.rows([PROMPT, PROMPT], list(LONG))
    eot = scorer.tokenizer.eot_id
    assert rows == [[eot, *w[-(SEQ_LEN - 1) :]] for w in whole]
    got = scorer.score_ids(rows, batch_size=1)
    assert got == [_direct(scorer, r) for r in rows] == api  # one row at a time: the same operations, bitwise
    # two rows in one batch: other matmul blocking than one row, FP32 rounding only (eps 6e-8 through
    # sums of width 32 and more; measured 1.4e-7 relative on rewards of ~14): 1e-5 relative
    assert reward.score([PROMPT, PROMPT], list(LONG)).rewards == pytest.approx(got, rel=1e-5)
    # the two ends differ by one word of ~3 tokens: measured |difference| ~0.5 on this head of unit scale
    print("rewards", got)
    assert abs(got[0] - got[1]) > 1e-3


def test_a_sequence_that_fits_is_read_whole(scorer):
    """A pair within ``seq_len`` is scored on its whole ids, as before the change: the reward is the model's
    on the rendered ids themselves (bitwise, one row) and the row is unchanged."""
    short = "Insert x."
    ids = ChatTemplate(scorer.tokenizer).render((Turn("user", "Describe f."), Turn("assistant", short)))[0]
    assert len(ids) <= SEQ_LEN
    reward = RewardModelReward(scorer, "chat")
    assert reward.rows(["Describe f."], [short]) == [ids]
    assert scorer.score_ids([ids], batch_size=1) == [_direct(scorer, ids)]
    text = f"{EOT}Describe f.{short}"
    plain = scorer.tokenizer.encode(text)
    assert len(plain) <= SEQ_LEN and score(scorer, [text], batch_size=1) == [_direct(scorer, plain)]
