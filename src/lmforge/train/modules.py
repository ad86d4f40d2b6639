"""What a training step drives: one :class:`TrainModule` per kind of objective.

The step (``train/step.py``) calls the same methods whatever it was given, and never asks what that is:
each micro-batch runs inside :meth:`TrainModule.micro_batch` (the data-parallel controls of accumulation)
through :meth:`TrainModule.forward_backward`; after the last one :meth:`TrainModule.finish_backward`
completes the step's gradients. Evaluation, the module's own metrics, the detail metrics' measuring
forward and the model's state go through the module too, so a callback never branches on the objective.

==================================  ========================================================================
module                              what it trains
==================================  ========================================================================
:class:`LanguageModelModule`        the next-token loss (``train.objective = lm``, and ``sft``: the same
                                    loss with targets -100 outside the responses)
:class:`PipelineModule`             the next-token loss through a pipeline schedule (``parallel.pp > 1``)
:class:`DPOModule`                  preference pairs (``train.objective = dpo``, ``posttrain/dpo.py``)
:class:`RLModule`                   rewards of sampled completions (``train.objective = rl``,
                                    ``posttrain/rl.py``)
:class:`RewardModule`               a reward model on preference pairs (``train.objective = reward``,
                                    ``posttrain/reward.py``)
==================================  ========================================================================

A new objective (RL) is a new class here with these methods, built in
``train/build.py``; the step and the trainer do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from lmforge.data.loader import Batch
from lmforge.evaluate.validation import token_loss_sum
from lmforge.model.loss import NextTokenLoss
from lmforge.model.moe import moe_metrics, start_step, take_aux_loss
from lmforge.parallel.data_parallel import GradientSync
from lmforge.parallel.expert import ExpertGradSync
from lmforge.parallel.pipeline import Pipeline
from lmforge.posttrain.dpo import DPOObjective
from lmforge.posttrain.reward import RewardObjective
from lmforge.posttrain.rl import RLObjective
from lmforge.precision import PrecisionPolicy
from lmforge.train.checkpoint import load_model_state, model_state

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets, doc_ids) -> (loss_sum, n)


class TrainModule(Protocol):
    """The protocol every training module follows (see the module docstring).

    ``model`` is this rank's plain network under the whole model's parameter names (a pipeline rank's
    stages in one module): what the optimizer, the checkpoints, the detail metrics and samples use.
    """

    model: nn.Module

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        """The context micro-batch ``index`` of ``count`` runs in: when data-parallel ranks synchronise
        gradients and (re)gather parameters during a step."""
        ...

    def forward_backward(
        self, batch: Batch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss divided by ``n_targets`` (the step's targets
        over every data-parallel rank) and multiplied by ``dp`` (undoing the ranks' gradient averaging);
        returns this rank's share of the step's loss, detached."""
        ...

    def finish_backward(self) -> None:
        """Once per step after the last micro-batch, before the gradients are read."""
        ...

    def evaluate(self, batches: Iterable, precision: PrecisionPolicy) -> dict[str, float]:
        """``val_loss`` (and the objective's other ``val_`` figures) over ``batches``, in eval mode and the
        run's autocast; the same on every rank."""
        ...

    def inspect_forward(self, batch: Batch, precision: PrecisionPolicy) -> bool:
        """One eager forward of ``batch`` through the whole network in eval mode, for hooks that measure
        it (the detail metrics); False where no process runs the whole network on whole tensors."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """The module's own figures since the last call (a record's extra entries)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by whole-model name (sharded ones as DTensors)."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def rank_state(self) -> dict:
        """This rank's state of the objective beside the weights (RL: a rollout cycle's kept rollouts),
        written per rank into checkpoints; ``{}`` when there is none."""
        ...

    def load_rank_state(self, state: dict) -> None: ...


@contextlib.contextmanager
def eval_mode(*modules: nn.Module):
    """``modules`` in eval mode inside the block, back to their modes after it."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)


class ModelState:
    """``state_dict`` / ``load_state_dict`` of a module's ``model`` in the checkpoints' format."""

    model: nn.Module

    def state_dict(self) -> dict[str, torch.Tensor]:
        return model_state(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_model_state(self.model, state)

    def rank_state(self) -> dict:
        """What this rank's objective keeps between steps, beside the weights (a checkpoint's per-rank
        part; RL: the rollouts of the current cycle); none for most objectives."""
        return {}

    def load_rank_state(self, state: dict) -> None:
        if state:
            raise ValueError("this objective keeps no state between steps, but the checkpoint holds some")


class LanguageModelModule(ModelState):
    """The next-token loss of ``model``: ``train_fn`` is the model and its loss transformed for training
    (compiled, sharded, wrapped), ``eval_fn`` the one evaluation calls (eager in one process: evaluation is
    too rare to pay for a second compiled graph; the training one where it is sharded). ``whole``: the
    rank runs the whole network on whole tensors (no tensor parallelism).

    With MoE layers (``model/moe.py``) each micro-batch's weighted balance losses join its loss with the
    micro-batch's share of the step's targets (``n_i / n_targets``, times ``dp`` as the loss), so the step
    trains on their token-weighted mean over micro-batches and ranks; the returned loss stays the
    next-token loss alone (the balance losses are in :meth:`take_metrics`)."""

    def __init__(
        self,
        model: nn.Module,
        train_fn: nn.Module,
        eval_fn: nn.Module,
        sync: GradientSync,
        whole: bool = True,
    ):
        self.model, self.train_fn, self.eval_fn, self.sync, self.whole = model, train_fn, eval_fn, sync, whole

    @classmethod
    def of(cls, loss: NextTokenLoss) -> LanguageModelModule:
        """One process, nothing transformed: ``loss`` (a model and its loss) trains and evaluates."""
        return cls(loss.model, loss, loss, GradientSync())

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        if index == 0:
            start_step(self.model)  # the MoE layers count this step's routing afresh
        return self.sync.micro_batch(index, count)

    def forward_backward(
        self, batch: Batch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        with precision.autocast():
            loss_sum, _ = self.train_fn(batch.inputs, batch.targets, batch.doc_ids)
        loss = loss_sum / n_targets
        objective = loss
        aux = take_aux_loss(self.model)
        if aux is not None:
            objective = loss + aux * (batch.n_targets / n_targets)
        precision.backward(objective * dp if dp != 1 else objective)
        return loss.detach()

    def finish_backward(self) -> None:
        self.sync.finish()

    def evaluate(self, batches: Iterable[Batch], precision: PrecisionPolicy) -> dict[str, float]:
        with eval_mode(self.eval_fn):
            total, count = token_loss_sum(self.eval_fn, batches, precision)
        return {"val_loss": total / max(count, 1)}

    @torch.no_grad()
    def inspect_forward(self, batch: Batch, precision: PrecisionPolicy) -> bool:
        if not self.whole:
            return False
        batch = batch.to(precision.device)
        # eager: compiled blocks (several processes) would recompile for a probe on every detail step
        with eval_mode(self.eval_fn), torch.compiler.set_stance("force_eager"), precision.autocast():
            self.eval_fn(batch.inputs, batch.targets, batch.doc_ids)
        return True

    def take_metrics(self) -> dict[str, float]:
        return moe_metrics(self.model)  # the MoE layers' routing of the last step (empty without them)


class PipelineModule(ModelState):
    """The next-token loss through ``pipeline``'s schedule (``parallel/pipeline.py``): each micro-batch of
    the step is one schedule step over this rank's stages; ``model`` holds them under the whole model's
    names. Figures are those of the last stage, summed over the pipeline group so every rank has them.

    MoE layers: each stage's balance losses ride on its output (``parallel/pipeline.py``), weighted as
    :class:`LanguageModelModule` weighs them; their routing figures are gathered over the pipeline group.
    ``experts``: the expert-parallel gradient sum (``parallel/expert.py::ExpertGradSync``; None without)."""

    def __init__(self, pipeline: Pipeline, model: nn.Module, experts: ExpertGradSync | None = None):
        self.pipeline, self.model, self.experts = pipeline, model, experts

    def micro_batch(self, index: int, count: int) -> contextlib.AbstractContextManager:
        if index == 0:
            start_step(self.model)  # the MoE layers count this step's routing afresh
        return contextlib.nullcontext()  # the schedule runs FSDP2's controls within its own microbatches

    def forward_backward(
        self, batch: Batch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        with precision.autocast():
            out = self.pipeline.step(batch.inputs, batch.targets, batch.doc_ids, loss_scale=dp / n_targets)
        if out is None:  # not the last stage's rank: its share is counted there
            return torch.zeros((), device=precision.device)
        return out.to(torch.promote_types(out.dtype, torch.float32)) / dp

    def finish_backward(self) -> None:
        self.pipeline.reduce_tied_grads()  # the tied embedding's copies: one sum per step
        if self.experts is not None:
            self.experts.finish()

    def evaluate(self, batches: Iterable[Batch], precision: PrecisionPolicy) -> dict[str, float]:
        total = torch.zeros((), dtype=torch.float32, device=precision.device)
        count = 0
        with eval_mode(*self.pipeline.models), precision.autocast():
            for batch in batches:
                out = self.pipeline.eval_loss(batch.inputs, batch.targets, batch.doc_ids)
                if out is not None:
                    total += out[0].float()
                count += int((batch.targets != -100).sum())
        dist.all_reduce(total, group=self.pipeline.group)
        return {"val_loss": float(total) / max(count, 1)}

    def inspect_forward(self, batch: Batch, precision: PrecisionPolicy) -> bool:
        return False  # no rank runs the whole network

    def take_metrics(self) -> dict[str, float]:
        """The bubble of the step's last schedule step, measured on this rank, and the formula's."""
        p = self.pipeline
        moe = moe_metrics(self.model, p.group) if p.has_moe_anywhere else {}
        return {"pp_bubble": p.last_bubble, "pp_bubble_formula": p.expected_bubble, **moe}


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


class RLModule(ModelState):
    """RL from rewards (``posttrain/rl.py::RLObjective``: sampling, rewards, the GRPO / RLOO / PPO losses,
    the metrics); ``sync``: the data-parallel controls of the transformed policy; ``group``: the
    data-parallel process group the metrics are summed over (None: one rank).

    MoE layers: the objective adds their balance losses to each micro-batch's loss (weighted by its share
    of the step's prompts); their routing counters restart at each step's first micro-batch and their
    figures join the record, as :class:`LanguageModelModule`'s. Only the policy's training forward counts:
    sampling and evaluation run in eval mode without gradient, the frozen reference in eval mode."""

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
