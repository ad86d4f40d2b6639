"""Rollout cycles make the PPO clip real (``rl.ppo_epochs``, ``rl.mini_batches``; ``posttrain/rl.py``).

A cycle's rollouts are drawn once, at its first step, and trained on at every later update of the cycle
with the old log-probabilities (PPO: old values) of the weights that drew them. Proved here on a float64
tiny model, against figures computed outside the objective from a copy of the sampling weights:

* the loader's order: mini-batches drawn at the first step (the later ones as ``ahead``), then replayed in
  order for each epoch, the next cycle starting after them;
* the old log-probabilities kept for every rollout equal a fresh forward of the sampling weights' copy;
* at a rollout's first update the ratio is 1 and the clip does not bind (gradients bitwise equal for
  ``clip_epsilon`` 1e-3 and 10, PPO's ``value_clip`` too); from its second update on the clip fraction is
  the share of tokens where the clipped term is taken, computed here by hand from the copy's and the
  current weights' log-probabilities, and it is above 0, and the gradients differ.

If the old log-probabilities were taken from the update's own forward again (``logp.detach()``), the ratio
would stay 1 and the second-update checks fail.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lmforge.config import ModelConfig, RLConfig
from lmforge.model.transformer import Transformer
from lmforge.posttrain.ppo import PolicyValueModel, PPOObjective, TokenLogpsValues
from lmforge.posttrain.reward_pool import RewardPool
from lmforge.posttrain.rl import RLObjective, TokenLogps
from lmforge.posttrain.rl_data import Prompt, PromptLoader
from lmforge.posttrain.rl_loss import EPS
from lmforge.precision import PrecisionPolicy

FP64 = PrecisionPolicy("fp64", torch.device("cpu"))
PROMPTS = [Prompt((1 + i, 2 + i, 3), f"p{i}", f"x:{i}") for i in range(8)]
G = 4


def _model(kind: type[Transformer]) -> Transformer:
    torch.manual_seed(0)
    model = kind(ModelConfig(n_layers=1, d_model=16, n_heads=2), 32, 32)
    model.init_weights()
    return model.double()


def _objective(model: Transformer, reward: RewardPool, **rl) -> RLObjective:
    cfg = RLConfig(group_size=G, max_new_tokens=4, reward="tests.rl_rewards:length", beta=0, **rl)
    decode = lambda ids: "x" * (sum(ids) % 5)  # noqa: E731 - a text whose length (the reward) varies
    ppo = isinstance(model, PolicyValueModel)
    policy = (TokenLogpsValues if ppo else TokenLogps)(model, chunk=16)
    return (PPOObjective if ppo else RLObjective)(policy, model, cfg, reward, 0, decode, 0, 7)


@pytest.fixture(scope="module")
def reward():
    pool = RewardPool("tests.rl_rewards:length", 5.0, 1, 0.0)
    yield pool
    pool.close()


def test_the_loader_draws_a_cycle_at_its_first_step_and_replays_it_per_epoch():
    """2 epochs x 2 mini-batches of 2 micro-batches, 2 ranks: the numbers each step trains on."""
    loaders = [PromptLoader(PROMPTS, 1, 0, rank, 2, 0, accum=2, epochs=2, mini_batches=2) for rank in (0, 1)]
    steps = [[[loader.next_batch() for _ in range(2)] for _ in range(5)] for loader in loaders]
    # rank r, micro-batch i of mini-batch j in a cycle from c: c + (j * 2 + i) * 2 + r (one prompt each)
    for r in (0, 1):
        got = [[b.position for b in step] for step in steps[r]]
        assert got == [[r, 2 + r], [4 + r, 6 + r], [r, 2 + r], [4 + r, 6 + r], [8 + r, 10 + r]]
        assert [[b.update for b in step] for step in steps[r]] == [[0, 0], [1, 1], [2, 2], [3, 3], [0, 0]]
        assert [[a.position for a in b.ahead] for b in steps[r][0]] == [[4 + r], [6 + r]]
        assert all(not b.ahead for step in steps[r][1:4] for b in step)
    # without cycles: the plain order, one call at a time
    plain = PromptLoader(PROMPTS, 1, 0, 1, 2, 0, accum=2)
    assert [plain.next_batch().position for _ in range(3)] == [1, 3, 5]


def _hand_clip_fraction(logp, old, adv, mask, eps) -> float:
    """Share of completion tokens where ``clip(rho) A < rho A`` (the clipped term taken)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
    taken = (torch.clamp(ratio, 1 - eps, 1 + eps) * a < ratio * a) & mask
    return float(taken.sum() / mask.sum())


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_old_logps_are_the_sampling_weights_and_the_clip_binds_from_the_second_update(kind, reward):
    """One cycle of 2 epochs x 2 mini-batches (4 updates) with a tight clip and a large step."""
    ppo = kind == "ppo"
    model = _model(PolicyValueModel if ppo else Transformer)
    sampling = copy.deepcopy(model)  # the weights the cycle's rollouts are drawn from
    eps = 1e-3
    objective = _objective(model, reward, algorithm=kind, clip_epsilon=eps, ppo_epochs=2, mini_batches=2)
    loader = PromptLoader(PROMPTS[:2], 1, 0, accum=1, epochs=2, mini_batches=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen: dict[int, torch.Tensor] = {}
    for update in range(4):
        batch = loader.next_batch()
        assert batch.update == update
        if update > 0:
            kept = objective.buffer.rollouts[batch.position]
            assert torch.equal(kept.inputs, seen[batch.position])  # not drawn again
            outputs = TokenLogps(sampling, chunk=16)(kept.inputs, kept.targets, kept.docs)
            torch.testing.assert_close(kept.old_logp, outputs[0], rtol=0, atol=1e-12)
            with torch.no_grad():
                now = TokenLogps(model, chunk=16)(kept.inputs, kept.targets, kept.docs)[0]
            if ppo:
                adv = kept.advantages
            else:
                r = kept.rewards.view(-1, G).double()
                adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + EPS)).flatten()
            assert adv.abs().sum() > 0  # rewards that differ within a group: a gradient to clip
            expected = _hand_clip_fraction(now, kept.old_logp, adv, kept.mask, eps)
        optimizer.zero_grad()
        objective.forward_backward(batch, len(batch.prompts), 1, FP64)
        optimizer.step()
        clip = objective.take_metrics()["rl/clip_fraction"]
        if update == 0:
            seen = {r_pos: r.inputs.clone() for r_pos, r in objective.buffer.rollouts.items()}
            assert len(seen) == 2  # both mini-batches drawn at the first step
            first = objective.buffer.rollouts[batch.position]
            reference = TokenLogps(sampling, chunk=16)(first.inputs, first.targets, first.docs)[0]
            torch.testing.assert_close(first.old_logp, reference, rtol=0, atol=1e-12)
            assert clip == 0.0  # ratio 1 at the first update
        else:
            assert clip == pytest.approx(expected, abs=1e-12) and clip > 0.0, (update, clip)
    assert not objective.buffer.rollouts  # spent after the cycle's last update


def _grads(kind: str, reward: RewardPool, updates: int, **rl) -> list[dict[str, torch.Tensor]]:
    model = _model(PolicyValueModel if kind == "ppo" else Transformer)
    objective = _objective(model, reward, algorithm=kind, ppo_epochs=2, **rl)
    loader = PromptLoader(PROMPTS[:2], 2, 0, accum=1, epochs=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(updates):
        optimizer.zero_grad()
        objective.forward_backward(loader.next_batch(), 2, 1, FP64)
        out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return out


@pytest.mark.parametrize(
    ("kind", "key"),
    [("grpo", "clip_epsilon"), ("rloo", "clip_epsilon"), ("ppo", "clip_epsilon"), ("ppo", "value_clip")],
)
def test_a_clip_changes_the_update_only_after_the_first(kind, key, reward):
    """Gradients for a clip of 1e-3 and of 10: bitwise equal at the first update (ratio 1, ``V = V^old``),
    different at the second (the same rollouts, the policy moved)."""
    tight, loose = _grads(kind, reward, 2, **{key: 1e-3}), _grads(kind, reward, 2, **{key: 10.0})
    assert all(torch.equal(tight[0][n], loose[0][n]) for n in tight[0])
    assert any(not torch.equal(tight[1][n], loose[1][n]) for n in tight[1])
