"""``train.objective = "reward"``: a reward model trained on ``[posttrain]`` pairs with ``[reward]``'s
settings, and :class:`RewardModule`, the training module it runs in.

The network is ``posttrain/reward.py::RewardModel`` (the transformer with a scalar head at the last real
token); its ``RewardScores`` go through the build's transformations, inside a ``RewardObjective`` (the
Bradley-Terry pair losses and the reward metrics). Registered for the build by the
``lmforge.objectives`` entry point ``reward`` (``pyproject.toml``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.transformer import Transformer
from lmforge.parallel.data_parallel import GradientSync
from lmforge.posttrain.objective_dpo import DPOModule
from lmforge.posttrain.reward import RewardModel, RewardObjective, RewardScores
from lmforge.posttrain.run import PostTraining
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import Tokenizer
from lmforge.train.modules import ModuleParts, eval_mode


class RewardModule(DPOModule):
    """A reward model (``posttrain/reward.py::RewardObjective``: the Bradley-Terry pair losses and the
    reward metrics) over the transformed ``RewardScores``; the data-parallel controls, evaluation and
    metrics as :class:`DPOModule`'s."""

    def __init__(
        self,
        model: nn.Module,
        objective: RewardObjective,
        sync: GradientSync,
        group: dist.ProcessGroup | None = None,
        whole: bool = True,
    ):
        self.model, self.objective, self.sync, self.group, self.whole = model, objective, sync, group, whole

    @torch.no_grad()
    def inspect_forward(self, batch, precision: PrecisionPolicy) -> bool:
        if not self.whole:
            return False
        scorer = self.objective.eval_scorer
        batch = batch.to(precision.device)
        with eval_mode(scorer), torch.compiler.set_stance("force_eager"), precision.autocast():
            scorer(batch.inputs)
        return True


def run_pad_id(cfg: Config) -> int:
    """The padding id of a post-training run's rows: its tokenizer's ``<|endoftext|>``."""
    return Tokenizer(cfg.data.tokenizer).eot_id


class RewardModelling(PostTraining):
    """The objective: two rows an example (a pair's sides), :class:`RewardModel`, its scores at each row's
    last real token (``RewardScores`` reads the padding id), :class:`RewardModule`; the data hooks of
    :class:`PostTraining`."""

    rows = 2

    def model_class(self, cfg: Config) -> type[Transformer]:
        return RewardModel

    def function(self, cfg: Config, model: Transformer) -> nn.Module:
        return RewardScores(model, run_pad_id(cfg))

    def module(self, parts: ModuleParts) -> RewardModule:
        objective = RewardObjective(parts.train_fn, parts.eval_fn)
        return RewardModule(parts.model, objective, parts.sync, parts.group, parts.whole)


OBJECTIVE = RewardModelling()
