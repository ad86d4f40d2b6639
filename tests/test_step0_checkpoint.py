"""A checkpoint that holds no optimizer state (what ``lmforge sft / dpo / reward / rl --from RUN`` starts
from: step 0, the weights only) must leave the optimizer untouched, so that the run's first update is
Adam's first step (bias correction 1 - beta^1), as it is for a run trained from scratch."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmforge.train.checkpoint import (
    list_checkpoints,
    load_model_state,
    load_optimizer_state,
    load_training_state,
    model_state,
    save_checkpoint,
)
from lmforge.train.runtime import rng_state


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def test_a_weights_only_checkpoint_leaves_the_first_update_a_first_adam_step(tmp_path):
    torch.manual_seed(0)
    start = nn.Linear(4, 3)
    state = {"model": model_state(start), "optimizer": {}, "rng": rng_state(), "progress": {"step": 0}}
    save_checkpoint(tmp_path, 0, state, "", keep=2)

    resumed = nn.Linear(4, 3)
    opt = torch.optim.AdamW(resumed.parameters(), lr=0.1)
    loaded = load_training_state(list_checkpoints(tmp_path)[-1], resumed, opt)
    load_model_state(resumed, loaded["model"])
    load_optimizer_state(resumed, opt, loaded["optimizer"])
    assert not opt.state  # no moments, no step counter: nothing was stepped yet

    fresh = copy.deepcopy(start)  # the same weights, stepped by a new AdamW: the expected first step
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    _step(resumed, opt, x)
    _step(fresh, fresh_opt, x)
    for a, b in zip(resumed.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)  # same ops on the same values in one process: bitwise
