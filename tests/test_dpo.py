"""DPO: the preference losses against hand-worked numbers, sequence log-probabilities against the
next-token loss, the objective inside the real training step, and the pair loader."""

from __future__ import annotations

import copy
import math
from collections import namedtuple
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import DPOConfig, ModelConfig
from lmforge.errors import ConfigError, DataError
from lmforge.model.loss import NextTokenLoss
from lmforge.optim.clip import Clipper
from lmforge.parallel.data_parallel import GradientSync
from lmforge.posttrain.dpo import DPOObjective, SequenceLogps, check_dpo, preference_loss
from lmforge.posttrain.dpo_data import (
    PairBatch,
    PairLoader,
    pair_eval_batches,
    pair_row,
    reference_logps,
    row_width,
    stack_pairs,
    tokenize_pairs,
)
from lmforge.posttrain.objective_dpo import DPOModule
from lmforge.precision import PrecisionPolicy
from lmforge.train.step import train_step
from tests.conftest import model_of

FP32 = PrecisionPolicy("fp32", torch.device("cpu"))
VOCAB, SEQ = 32, 16
LOG2 = math.log(2.0)

# A stand-in chat template: contents are token ids; role tokens 1..3, end token 4, document start 0;
# the mask is True on assistant content and its end token.
Turn = namedtuple("Turn", "role content")
ROLE_ID = {"system": 1, "user": 2, "assistant": 3}


def render(turns) -> tuple[list[int], list[bool]]:
    ids, mask = [0], [False]
    for turn in turns:
        body = [*turn.content, 4]
        ids += [ROLE_ID[turn.role], *body]
        mask += [False] + [turn.role == "assistant"] * len(body)
    return ids, mask


def pair(prompt, chosen, rejected, source="f.jsonl:1"):
    return SimpleNamespace(
        prompt=(Turn("user", tuple(prompt)),),
        chosen=(Turn("assistant", tuple(chosen)),),
        rejected=(Turn("assistant", tuple(rejected)),),
        source=source,
    )


def toy_pairs(n: int, seed: int = 0) -> list:
    """``n`` pairs of random tokens 5..31; pair ``i``'s prompt starts with token ``5 + i`` (its mark)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [5 + i % 27, *rng.integers(5, VOCAB, 2)]
        out.append(pair(prompt, rng.integers(5, VOCAB, 4), rng.integers(5, VOCAB, 3), f"f.jsonl:{i + 1}"))
    return out


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return model_of(ModelConfig(n_layers=2, d_model=32, n_heads=4), VOCAB, SEQ)


def t64(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# -- the losses, worked by hand -----------------------------------------------------------------------

# These compare float64 losses with values worked by hand (log(1 + e^x) to 16 digits) under assert_close's
# float64 default (1e-7 relative + 1e-7): a few float64 operations, rounding at ~1e-16 (measured <= 1.1e-16).
# The default is rounding room, not a machine's figure; it hid a hand value wrong in its 8th digit
# (0.82593945... for log(1 + e^0.25) = 0.82593941...), corrected here.
# pair 0: h = (pc - rc) - (pr - rr) = (-1 + 2) - (-3 + 2) = 2; pair 1: h = (-2 + 2) - (-2 + 2.5) = -0.5
PC, PR, RC, RR = t64(-1.0, -2.0), t64(-3.0, -2.0), t64(-2.0, -2.0), t64(-2.0, -2.5)


def test_sigmoid_loss_by_hand():
    losses, chosen, rejected = preference_loss(PC, PR, RC, RR, beta=0.5)
    # beta*h = 1 and -0.25: -log sigmoid(x) = log(1 + e^-x)
    torch.testing.assert_close(losses, t64(math.log(1 + math.exp(-1)), math.log(1 + math.exp(0.25))))
    # float64 default tolerances: see the note above PC
    torch.testing.assert_close(losses, t64(0.3132616875182228, 0.8259394198788436))
    torch.testing.assert_close(chosen, t64(0.5, 0.0))  # 0.5 * (pc - rc)
    torch.testing.assert_close(rejected, t64(-0.5, 0.25))  # 0.5 * (pr - rr)


def test_sigmoid_label_smoothing_by_hand():
    losses, _, _ = preference_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    # 0.9 * log(1 + e^-x) + 0.1 * log(1 + e^x) with x = 1 and -0.25
    pair0 = 0.9 * 0.3132616875182228 + 0.1 * 1.3132616875182228
    pair1 = 0.9 * 0.8259394198788436 + 0.1 * 0.5759394198788436
    # float64 default tolerances: see the note above PC
    torch.testing.assert_close(losses, t64(pair0, pair1))
    torch.testing.assert_close(losses, t64(0.4132616875182228, 0.8009394198788436))


def test_ipo_loss_by_hand():
    losses, chosen, rejected = preference_loss(PC, PR, RC, RR, beta=0.25, loss="ipo")
    # target 1 / (2 * 0.25) = 2: (2 - 2)^2 = 0 and (-0.5 - 2)^2 = 6.25
    # float64 default tolerances (see the note above PC); these values are exact in binary
    torch.testing.assert_close(losses, t64(0.0, 6.25))
    torch.testing.assert_close(chosen, t64(0.25, 0.0))
    torch.testing.assert_close(rejected, t64(-0.25, 0.125))
    with pytest.raises(ValueError, match="label smoothing"):
        preference_loss(PC, PR, RC, RR, beta=0.25, loss="ipo", label_smoothing=0.1)


def test_hinge_loss_by_hand():
    losses, _, _ = preference_loss(PC, PR, RC, RR, beta=0.25, loss="hinge")
    # beta*h = 0.5 and -0.125: relu(1 - 0.5) = 0.5, relu(1 + 0.125) = 1.125
    torch.testing.assert_close(losses, t64(0.5, 1.125))
    smoothed, _, _ = preference_loss(PC, PR, RC, RR, beta=0.25, loss="hinge", label_smoothing=0.2)
    # 0.8 * relu(1 - bh) + 0.2 * relu(1 + bh): 0.8 * 0.5 + 0.2 * 1.5 = 0.7; 0.8 * 1.125 + 0.2 * 0.875 = 1.075
    torch.testing.assert_close(smoothed, t64(0.7, 1.075))


def test_ipo_with_label_smoothing_is_a_config_error():
    with pytest.raises(ConfigError, match=r"dpo\.label_smoothing"):
        check_dpo(DPOConfig(loss="ipo", label_smoothing=0.1))
    check_dpo(DPOConfig(loss="hinge", label_smoothing=0.1))


# -- sequence log-probabilities ----------------------------------------------------------------------


def test_sequence_logps_agree_with_next_token_loss():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (5, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (5, SEQ), generator=g)
    y[:, :6] = -100  # prompts
    y[3, 10:] = -100  # padding
    logps = SequenceLogps(model, chunk=7)(x, y)  # chunks cross row boundaries
    assert logps.shape == (5,) and logps.dtype == torch.float32
    loss_sum, n = NextTokenLoss(model, chunk=1024)(x, y)
    assert int(n) == int((y != -100).sum())
    # FP32 sums of the same <= 154 token losses grouped by rows or chunks (worst case 154 u = 9e-6 relative,
    # u = 2^-24; random-walk ~7e-7): measured bitwise equal on a 2-core AMD EPYC with AVX-512-BF16
    torch.testing.assert_close(-logps.sum(), loss_sum, rtol=1e-6, atol=0)
    for i in range(5):  # each row's sum is that row's own loss (<= 26 tokens: 26 u = 1.5e-6; measured equal)
        row_loss, _ = NextTokenLoss(model, chunk=0)(x[i : i + 1], y[i : i + 1])
        # rtol 1e-5: ~7x the 26 u worst case above; atol 1e-6 is far below row sums of tens
        torch.testing.assert_close(-logps[i], row_loss, rtol=1e-5, atol=1e-6)


# -- tokenising pairs ---------------------------------------------------------------------------------


def test_tokenize_pairs_skip_truncate_and_rows():
    long = pair([5, 6], list(range(5, 20)), [7], "f.jsonl:2")  # chosen: 1+1+3 + 1+16 = 22 tokens
    prompt_only = pair(list(range(5, 25)), [7], [8], "f.jsonl:3")  # prompt alone over the limit
    good = pair([5, 6], [9, 10], [11], "f.jsonl:1")
    kept, skipped = tokenize_pairs([good, long, prompt_only], render, SEQ, "skip")
    assert [p.source for p in kept] == ["f.jsonl:1"]
    assert [s for s, _ in skipped] == ["f.jsonl:2", "f.jsonl:3"]
    assert "chosen: over the length limit: 22 tokens > data.seq_len+1 = 17" in skipped[0][1]
    kept, skipped = tokenize_pairs([good, long, prompt_only], render, SEQ, "truncate")
    assert [p.source for p in kept] == ["f.jsonl:1", "f.jsonl:2"] and len(kept[1].chosen_ids) == SEQ + 1
    assert skipped == [
        ("f.jsonl:3", "chosen: no response tokens within data.seq_len (the prompt fills it); "
         "rejected: no response tokens within data.seq_len (the prompt fills it)")
    ]  # fmt: skip
    batch = stack_pairs(kept[:1], SEQ, pad_id=0)
    # chosen row: ids 0 2 5 6 4 3 9 10 4 -> targets on 9 10 4 only
    assert batch.inputs[0, :9].tolist() == [0, 2, 5, 6, 4, 3, 9, 10, 0]  # ids[:-1], then padding
    assert batch.targets[0].tolist() == [-100] * 5 + [9, 10, 4] + [-100] * 8
    assert batch.targets[1].tolist() == [-100] * 5 + [11, 4] + [-100] * 9
    assert batch.doc_ids[0].tolist() == [0] * 8 + [1] * 8 and batch.n_targets == 1 and batch.ref_logps is None


# -- the objective ------------------------------------------------------------------------------------


def _setup(n_pairs=8, seed=0, **kw):
    model = tiny_model(seed)
    policy = SequenceLogps(model, chunk=16)
    pairs, _ = tokenize_pairs(toy_pairs(n_pairs), render, SEQ, "skip")
    ref = reference_logps(policy, pairs, SEQ, 3, FP32)
    return model, policy, pairs, ref, DPOObjective(policy, **kw)


def _grad_norm(model) -> float:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()


@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_gradients_vanish_as_beta_goes_to_zero(loss):
    norms = {}
    for beta in (0.1, 1e-8):
        model, _, pairs, ref, obj = _setup(beta=beta, loss=loss)
        batch = stack_pairs(pairs[:4], SEQ, ref=ref[:4])
        obj.forward_backward(batch, batch.n_targets, 1, FP32)
        norms[beta] = _grad_norm(model)
    # a floor, not a fit: the beta = 0.1 gradient must be live (not zero) for the ratio below to mean anything
    assert norms[0.1] > 1e-4
    if loss == "ipo":  # the target 1/(2 beta) grows as beta shrinks: the pull gets stronger, not weaker
        assert norms[1e-8] > norms[0.1]
    else:  # the gradient scales with beta (sigmoid: beta / 2 at h = 0): 1e-7 of it expected, 1e-6 is 10x
        assert norms[1e-8] < 1e-6 * norms[0.1]


def test_identical_responses_give_zero_margin_and_log2():
    model = tiny_model()
    policy = SequenceLogps(model, chunk=16)
    same = [pair([5 + i, 6], [7, 8 + i], [7, 8 + i]) for i in range(3)]
    pairs, _ = tokenize_pairs(same, render, SEQ, "skip")
    ref = reference_logps(policy, pairs, SEQ, 2, FP32) - 0.7  # any reference: h = 0 when chosen = rejected
    obj = DPOObjective(policy, beta=0.1, label_smoothing=0.2)
    batch = stack_pairs(pairs, SEQ, ref=ref)
    loss = obj.forward_backward(batch, batch.n_targets, 1, FP32)
    # identical rows give identical log-probabilities, so h = 0 exactly and the loss is log 2 in FP32 (one
    # rounding, 3e-8; measured equal) and the margin 0 (measured 0)
    torch.testing.assert_close(loss, torch.tensor(LOG2), rtol=1e-6, atol=0)
    m = obj.take_metrics()
    # h = 0 exactly (see above), so the margin is 0 (measured 0); abs 1e-7 is FP32 rounding room
    assert m["rewards/margins"] == pytest.approx(0.0, abs=1e-7) and m["rewards/accuracies"] == 0.0
    # 0.1 x 0.7 from FP32 log-probabilities near -30 minus (them - 0.7): cancellation leaves ulp(30) = 1.9e-6
    # of 0.7, 2.7e-6 relative; measured 2.4e-7. 1e-4 is 37x the worst case
    assert m["rewards/chosen"] == pytest.approx(0.07, rel=1e-4) and m["logps/chosen"] < 0
    assert obj.take_metrics() == {}  # reset


def rule_pairs(n: int, seed: int) -> list:
    """``n`` pairs that follow one rule a model can learn and carry to unseen pairs: random prompts,
    chosen responses of tokens 5..17, rejected ones of tokens 18..31."""
    rng = np.random.default_rng(seed)
    return [
        pair(
            rng.integers(5, VOCAB, 3), rng.integers(5, 18, 4), rng.integers(18, VOCAB, 3), f"f.jsonl:{i + 1}"
        )
        for i in range(n)
    ]


def test_training_raises_the_margin():
    """Trained on 8 pairs, the margin rises on 6 held-out pairs it never saw (other prompts and responses,
    the same rule). Measured on them after 6 steps: margin 1.42, accuracy 1.0, loss 0.24."""
    model = tiny_model(0)
    policy = SequenceLogps(model, chunk=16)
    pairs, _ = tokenize_pairs(rule_pairs(8, seed=0), render, SEQ, "skip")
    unseen, _ = tokenize_pairs(rule_pairs(6, seed=1), render, SEQ, "skip")
    seen = {p.chosen_ids.tobytes() for p in pairs} | {p.rejected_ids.tobytes() for p in pairs}
    assert not seen & ({p.chosen_ids.tobytes() for p in unseen} | {p.rejected_ids.tobytes() for p in unseen})
    ref = reference_logps(policy, pairs, SEQ, 3, FP32)
    obj = DPOObjective(policy, beta=0.5)
    held = list(pair_eval_batches(unseen, SEQ, 3, reference_logps(policy, unseen, SEQ, 3, FP32)))
    before = obj.evaluate(held, FP32)
    # policy = reference at step 0: h is the difference of equal FP32 values, the loss log 2 up to FP32
    # rounding of the mean (measured 1.9e-9 from it); 1e-6 is 16 FP32 ulps of log 2
    assert before["val_loss"] == pytest.approx(LOG2, abs=1e-6) and before["val_rewards/margins"] == 0.0
    loader = PairLoader(pairs, SEQ, micro_batch_size=2, seed=0)
    loader.set_reference(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    module = DPOModule(model, obj, GradientSync())
    losses = []
    for _ in range(6):
        step = train_step(
            module, opt, [loader.next_batch(), loader.next_batch()], 0.2, Clipper("norm", 0.0), FP32
        )
        losses.append(step.loss.item())
    m = obj.take_metrics()
    after = obj.evaluate(held, FP32)
    assert set(m) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                      "logps/chosen", "logps/rejected"}  # fmt: skip
    # step 0's loss is log 2 up to FP32 rounding, as above (measured 1.9e-9 from it)
    assert losses[0] == pytest.approx(LOG2, abs=1e-6) and losses[-1] < losses[0] - 0.1
    assert after["val_rewards/margins"] > 0.5 and after["val_rewards/accuracies"] == 1.0
    assert after["val_loss"] < LOG2 - 0.1 and obj.policy.training  # evaluation puts the mode back


def test_micro_batches_give_the_gradient_of_one_batch():
    grads = {}
    for split in (1, 2):
        model, _, pairs, ref, obj = _setup(beta=0.5)
        with torch.no_grad():
            model.blocks[0].attn.o_proj.weight.mul_(1.5)  # policy != reference: a nonzero margin
        size = 4 // split
        batches = [stack_pairs(pairs[i : i + size], SEQ, ref=ref[i : i + size]) for i in range(0, 4, size)]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        weight = model.embed.weight  # the hook's last call sees the step's whole gradient
        hook = weight.register_post_accumulate_grad_hook(
            lambda p, s=split: grads.__setitem__(s, p.grad.clone())
        )
        loss = train_step(
            DPOModule(model, obj, GradientSync()), opt, batches, 0.0, Clipper("norm", 0.0), FP32
        ).loss
        hook.remove()
        grads[f"loss{split}"] = loss
    # the scaled o_proj moves the loss 1.2e-3 from log 2 (measured): a margin of the model, not of rounding
    assert grads["loss1"].item() != pytest.approx(LOG2, abs=1e-3)
    # one batch or two micro-batches: the same FP32 terms grouped in other sums. Measured: losses equal,
    # embedding gradients 6e-8 apart (1e-7 of the largest, 0.585). The absolute bound scales with the largest
    # element (sums of terms of that size round at u = 6e-8 of it: 1e-6 is 16 u); rtol covers the rest
    torch.testing.assert_close(grads["loss1"], grads["loss2"], rtol=1e-6, atol=0)
    torch.testing.assert_close(grads[1], grads[2], rtol=1e-5, atol=1e-6 * grads[1].abs().max().item())


def test_reference_model_matches_cached_reference():
    model, policy, pairs, ref, cached = _setup(beta=0.3)
    frozen = SequenceLogps(copy.deepcopy(model), chunk=16)
    with torch.no_grad():
        model.blocks[1].attn.o_proj.weight.mul_(0.5)  # the policy moved away from the reference
    live = DPOObjective(policy, beta=0.3, reference=frozen)
    batches = list(pair_eval_batches(pairs, SEQ, 4, ref))
    a, b = cached.evaluate(batches, FP32), live.evaluate(batches, FP32)
    assert a["val_rewards/margins"] != 0.0
    # the same FP32 forward of the frozen copy, cached or live: measured equal; the bound is FP32 rounding
    # room for a reference scored in other batch shapes (sums of <= 26 tokens: 26 u = 1.5e-6)
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    assert not any(p.requires_grad for p in frozen.parameters())
    with pytest.raises(RuntimeError, match="ref_logps"):
        cached.forward_backward(stack_pairs(pairs[:2], SEQ), 2, 1, FP32)


def test_ipo_uses_per_token_averages():
    _, policy, pairs, ref, obj = _setup(beta=0.5, loss="ipo")
    batch = stack_pairs(pairs[:3], SEQ, ref=ref[:3])
    obj.forward_backward(batch, 3, 1, FP32)
    tokens = (batch.targets != -100).sum(1).float()
    with torch.no_grad():
        avg = policy(batch.inputs, batch.targets) / tokens
    # FP32 means of 3 per-token averages in another order: measured 2.3e-8 relative, within a few u
    assert obj.take_metrics()["logps/chosen"] == pytest.approx(avg[:3].mean().item(), rel=1e-6)


def test_no_sync_reaches_the_ddp_policy(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_model()
        policy = DistributedDataParallel(SequenceLogps(model, chunk=16))
        module = DPOModule(model, DPOObjective(policy, beta=0.1), GradientSync(policy))
        with module.micro_batch(0, 2):
            assert not policy.require_backward_grad_sync
        with module.micro_batch(1, 2):
            assert policy.require_backward_grad_sync
    finally:
        dist.destroy_process_group()


# -- the loader ---------------------------------------------------------------------------------------


def _marks(batch: PairBatch) -> list[int]:
    """Pair index of each pair in a batch, read from its prompt's first token (``toy_pairs``)."""
    k = batch.n_pairs
    assert torch.equal(batch.inputs[:k, :3], batch.inputs[k:, :3])  # row i and k+i are one pair
    return [int(t) - 5 for t in batch.inputs[:k, 2]]


def test_pair_loader_epochs_ranks_reference_and_exact_resume():
    pairs, _ = tokenize_pairs(toy_pairs(10), render, SEQ, "skip")
    ref = np.stack([np.arange(10), -np.arange(10)], axis=1).astype(np.float32)
    ranks = [PairLoader(pairs, SEQ, 2, seed=3, rank=r, world=2) for r in (0, 1)]
    for loader in ranks:
        loader.set_reference(ref)
    seen = []
    for _ in range(5):  # 5 micro-steps x 2 ranks x 2 pairs = two epochs of 10
        for loader in ranks:
            batch = loader.next_batch()
            marks = _marks(batch)
            assert batch.ref_logps.tolist() == [*marks, *(-m for m in marks)]  # looked up by pair id
            moved = batch.to(torch.device("cpu"))
            assert isinstance(moved, PairBatch) and torch.equal(moved.ref_logps, batch.ref_logps)
            seen += marks
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:] and ranks[0].epoch == 2.0  # reshuffled each epoch

    a = PairLoader(pairs, SEQ, 3, seed=7)
    a.set_reference(ref)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(5)]
    b = PairLoader(pairs, SEQ, 3, seed=0)  # the seed comes from the state
    b.set_reference(ref)
    b.load_state_dict(state)
    for want, got in zip(expected, [b.next_batch() for _ in range(5)], strict=True):
        for name in ("inputs", "targets", "doc_ids", "ref_logps"):
            assert torch.equal(getattr(want, name), getattr(got, name))
    with pytest.raises(DataError, match=r"posttrain\.train_files"):
        PairLoader(pairs[:9], SEQ, 3, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match=r"dpo\.reference"):
        b.set_reference(ref[:9])


def test_reference_logps_split_over_ranks_sum_to_the_whole():
    model = tiny_model()
    policy = SequenceLogps(model, chunk=16)
    pairs, _ = tokenize_pairs(toy_pairs(7), render, SEQ, "skip")
    whole = reference_logps(policy, pairs, SEQ, 4, FP32)
    parts = [reference_logps(policy, pairs, SEQ, 2, FP32, rank=r, world=3) for r in range(3)]
    # the same rows scored in other batches: FP32 sums of <= 26 tokens (26 u = 1.5e-6); measured equal
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-6)
    assert (whole < 0).all() and policy.training  # mode given back
    one = stack_pairs(pairs[2:3], SEQ)
    with torch.no_grad():
        # the row alone or in a batch: FP32 sums of <= 26 tokens as above (26 u = 1.5e-6 worst case, random
        # walk sqrt(26) u = 3e-7); measured equal
        np.testing.assert_allclose(
            policy(one.inputs, one.targets).numpy(), whole[2], rtol=1e-6
        )  # measured equal


def test_rows_are_padded_to_the_longest_pair_and_score_as_full_rows():
    """A batch of short pairs is padded to a multiple of 64 above its longest sequence (not seq_len), and
    the log-probabilities equal those of the same rows padded to seq_len (padding follows the sequence:
    causal attention never sees it)."""
    assert [row_width(n, 256) for n in (1, 64, 65, 200, 300)] == [64, 64, 128, 256, 256]
    torch.manual_seed(0)
    model = model_of(ModelConfig(n_layers=2, d_model=32, n_heads=4), VOCAB, 200)
    pairs, _ = tokenize_pairs(toy_pairs(4), render, 200, "skip")
    short = stack_pairs(pairs, 200)
    longest = max(max(len(p.chosen_ids), len(p.rejected_ids)) - 1 for p in pairs)
    assert short.inputs.shape[1] == row_width(longest, 200) < 200
    full = [pair_row(p.chosen_ids, p.chosen_mask, 200) for p in pairs]
    full += [pair_row(p.rejected_ids, p.rejected_mask, 200) for p in pairs]
    x, y, d = (torch.from_numpy(np.stack(c)) for c in zip(*full, strict=True))
    scorer = SequenceLogps(model, chunk=16)
    # default FP32 tolerances (rtol 1.3e-6 = 22 u, atol 1e-5): the same rows at another padded width
    torch.testing.assert_close(scorer(short.inputs, short.targets, short.doc_ids), scorer(x, y, d))
