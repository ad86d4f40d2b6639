"""``train.objective = "dpo"``: direct preference optimisation on ``[posttrain]`` pairs with ``[dpo]``'s
settings, and :class:`DPOModule`, the training module it runs in.

The transformer's ``SequenceLogps`` (each sequence's log-probability, ``posttrain/dpo.py``) through the
build's transformations, inside a ``DPOObjective`` with its reference (``posttrain/run.py::dpo_objective``:
cached log-probabilities or a frozen whole copy). Registered for the build by the ``lmforge.objectives``
entry point ``dpo`` (``pyproject.toml``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.model.transformer import Transformer
from lmforge.parallel.data_parallel import GradientSync
from lmforge.posttrain.dpo import DPOObjective, SequenceLogps
from lmforge.posttrain.run import PostTraining, dpo_objective
from lmforge.precision import PrecisionPolicy
from lmforge.train.modules import ModelState, ModuleParts, eval_mode


class DPOModule(ModelState):
    """Direct preference optimisation (``posttrain/dpo.py::DPOObjective``: the pair losses, the reference,
    the metrics); ``sync``: the data-parallel controls of the transformed policy; ``group``: the
    data-parallel process group the metrics are summed over (None: one rank)."""

    def __init__(
        self,
        model: nn.Module,
        objective: DPOObjective,
        sync: GradientSync,
        group: dist.ProcessGroup | None = None,
        whole: bool = True,
    ):
        self.model, self.objective, self.sync, self.group, self.whole = model, objective, sync, group, whole

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        return self.sync.micro_batch(index, count)

    def forward_backward(self, batch, n_targets: int, dp: int, precision: PrecisionPolicy) -> torch.Tensor:
        return self.objective.forward_backward(batch, n_targets, dp, precision)

    def finish_backward(self) -> None:
        return None

    def evaluate(self, batches: Iterable, precision: PrecisionPolicy) -> dict[str, float]:
        return self.objective.evaluate(batches, precision, self.group)

    @torch.no_grad()
    def inspect_forward(self, batch, precision: PrecisionPolicy) -> bool:
        if not self.whole:
            return False
        policy = self.objective.eval_policy
        batch = batch.to(precision.device)
        with eval_mode(policy), torch.compiler.set_stance("force_eager"), precision.autocast():
            policy(batch.inputs, batch.targets, batch.doc_ids)
        return True

    def take_metrics(self) -> dict[str, float]:
        return self.objective.take_metrics(self.group)


class DirectPreference(PostTraining):
    """The objective: two rows an example (a pair's sides), the transformer, each sequence's
    log-probability, :class:`DPOModule`; the data hooks of :class:`PostTraining`."""

    rows = 2

    def model_class(self, cfg: Config) -> type[Transformer]:
        return Transformer

    def function(self, cfg: Config, model: Transformer) -> nn.Module:
        return SequenceLogps(model, cfg.train.loss_chunk)

    def module(self, parts: ModuleParts) -> DPOModule:
        objective = dpo_objective(
            parts.cfg, parts.train_fn, parts.fresh, parts.run_dir, eval_policy=parts.eval_fn
        )
        return DPOModule(parts.model, objective, parts.sync, parts.group, parts.whole)


OBJECTIVE = DirectPreference()
