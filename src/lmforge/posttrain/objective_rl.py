"""``train.objective = "rl"``: policy gradient from rewards on ``[posttrain]`` prompts with ``[rl]``'s
settings (GRPO, RLOO, ..., and PPO with its value head), and :class:`RLModule`, the training module it
runs in.

The policy's per-token log-probabilities (``posttrain/rl.py::TokenLogps``; PPO:
``posttrain/ppo.py::TokenLogpsValues`` of ``PolicyValueModel``, the transformer plus a scalar value head)
go through the build's transformations, inside an ``RLObjective`` (``PPOObjective``) that samples its
completions from the plain model or from a whole copy gathered before each rollout
(:func:`rl_module_objective`). Registered for the build by the ``lmforge.objectives`` entry point ``rl``
(``pyproject.toml``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.moe import moe_metrics, start_step
from lmforge.model.transformer import Transformer
from lmforge.parallel.data_parallel import GradientSync
from lmforge.parallel.layout import Layout
from lmforge.parallel.whole_copy import WholeCopy
from lmforge.posttrain.ppo import PolicyValueModel, TokenLogpsValues
from lmforge.posttrain.rl import RLObjective, TokenLogps
from lmforge.posttrain.run import PostTraining, rl_objective
from lmforge.precision import PrecisionPolicy
from lmforge.train.modules import ModelState, ModuleParts


class RLModule(ModelState):
    """RL from rewards (``posttrain/rl.py::RLObjective``: sampling, rewards, the GRPO / RLOO / PPO losses,
    the metrics); ``sync``: the data-parallel controls of the transformed policy; ``group``: the
    data-parallel process group the metrics are summed over (None: one rank).

    MoE layers: the objective adds their balance losses to each micro-batch's loss (weighted by its share
    of the step's prompts); their routing counters restart at each step's first micro-batch and their
    figures join the record, as ``train/modules.py::LanguageModelModule``'s. Only the policy's training
    forward counts: sampling and evaluation run in eval mode without gradient, the frozen reference in eval
    mode."""

    def __init__(
        self,
        model: nn.Module,
        objective: RLObjective,
        sync: GradientSync,
        group: dist.ProcessGroup | None = None,
    ):
        self.model, self.objective, self.sync, self.group = model, objective, sync, group

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        if index == 0:
            start_step(self.model)  # the MoE layers count this step's routing afresh
        return self.sync.micro_batch(index, count)

    def forward_backward(self, batch, n_targets: int, dp: int, precision: PrecisionPolicy) -> torch.Tensor:
        return self.objective.forward_backward(batch, n_targets, dp, precision)

    def finish_backward(self) -> None:
        self.sync.finish()

    def evaluate(self, batches: Iterable, precision: PrecisionPolicy) -> dict[str, float]:
        return self.objective.evaluate(batches, precision, self.group)

    def inspect_forward(self, batch, precision: PrecisionPolicy) -> bool:
        return False  # a prompt batch is no forward of the network; the rollouts are drawn in the step

    def take_metrics(self) -> dict[str, float]:
        return {**self.objective.take_metrics(self.group), **moe_metrics(self.model)}

    def rank_state(self) -> dict:
        return self.objective.state_dict()

    def load_rank_state(self, state: dict) -> None:
        self.objective.load_state_dict(state)


def rl_module_objective(
    cfg: Config,
    policy: nn.Module,
    model: Transformer,
    fresh: Callable[..., Transformer],
    layout: Layout,
    device: torch.device,
    run_dir: Path | None,
) -> RLObjective:
    """The RL objective of a training module: completions sampled from ``model`` itself where this process
    holds it whole, else (FSDP2, tensor parallelism, expert parallelism) from a whole copy gathered before
    each rollout (``parallel/whole_copy.py``); under tensor parallelism the group's first rank samples for
    the group."""
    tp = layout.degrees["tp"] > 1
    if layout.kind != "fsdp" and not tp and layout.ep == 1:
        return rl_objective(cfg, policy, model, fresh, run_dir, device)
    whole = WholeCopy(model, fresh(adapters=True))
    tp_group = layout.group("tp") if tp else None
    return rl_objective(cfg, policy, whole.copy, fresh, run_dir, device, whole.refresh, tp_group)


class ReinforcementLearning(PostTraining):
    """The objective: one row a prompt, the transformer (PPO: :class:`PolicyValueModel`), its per-token
    log-probabilities (PPO: and values), :class:`RLModule`; the data hooks of :class:`PostTraining`."""

    rows = 1

    def model_class(self, cfg: Config) -> type[Transformer]:
        return PolicyValueModel if cfg.rl.algorithm == "ppo" else Transformer

    def function(self, cfg: Config, model: Transformer) -> nn.Module:
        kind = TokenLogpsValues if cfg.rl.algorithm == "ppo" else TokenLogps  # PPO: its value head's values
        return kind(model, cfg.train.loss_chunk)

    def module(self, parts: ModuleParts) -> RLModule:
        c = parts
        objective = rl_module_objective(c.cfg, c.train_fn, c.model, c.fresh, c.layout, c.device, c.run_dir)
        return RLModule(c.model, objective, c.sync, c.group)


OBJECTIVE = ReinforcementLearning()
