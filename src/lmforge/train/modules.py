"""What a training step drives, and what the build asks of an objective to make it.

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
``DPOModule``                       preference pairs (``dpo``: ``posttrain/objective_dpo.py``)
``RewardModule``                    a reward model on preference pairs (``reward``:
                                    ``posttrain/objective_reward.py``)
``RLModule``                        rewards of sampled completions (``rl``: ``posttrain/objective_rl.py``)
==================================  ========================================================================

Which module, network, data and loader a run gets is its objective's (``train.objective``): an
:class:`Objective` registered under that name (:func:`register`, :func:`objective_for`). The build
(``train/build.py``) calls its hooks and names no objective; ``lm`` (:class:`LanguageModel`) is
registered here, every other objective by the package that defines it, through the entry-point group
``lmforge.objectives`` (``pyproject.toml``: post-training's in ``posttrain/objective_*.py``), loaded on
the first lookup of its name. A new objective is a new module with an :class:`Objective` (and, if its
step is no token loss, a :class:`TrainModule`) and one entry point; the build, the step and the trainer
do not change.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import Config
from lmforge.data.loader import Batch, TokenStream, TrainLoader
from lmforge.data.mixture import build_train_loader, check_domains
from lmforge.data.prepare import PreparedData, input_files, prepare_data
from lmforge.errors import ConfigError
from lmforge.evaluate.validation import token_loss_sum
from lmforge.model.loss import NextTokenLoss
from lmforge.model.moe import moe_metrics, start_step, take_aux_loss
from lmforge.model.transformer import Transformer
from lmforge.parallel.data_parallel import GradientSync
from lmforge.parallel.expert import ExpertGradSync
from lmforge.parallel.layout import Layout
from lmforge.parallel.pipeline import Pipeline
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


# --- objectives: what the build asks of each ``train.objective`` -------------------------------------


@dataclass(frozen=True)
class ModuleParts:
    """What the build hands an objective's :meth:`Objective.module` hook: the pieces it built, by name."""

    cfg: Config
    model: Transformer  # this rank's plain network (materialised, initialised)
    train_fn: nn.Module  # Objective.function over ``model``, transformed (parallel/apply.py)
    eval_fn: nn.Module  # what evaluation calls: eager in one process, ``train_fn`` under FSDP2
    sync: GradientSync  # the data-parallel controls of ``train_fn``
    layout: Layout
    device: torch.device
    run_dir: Path | None  # the run folder (a reference in it), None outside a run
    fresh: Callable[..., Transformer]  # ``fresh(adapters=False)``: a whole plain model, unfilled

    @property
    def whole(self) -> bool:
        """This rank runs the whole network on whole tensors (no tensor parallelism)."""
        return self.layout.degrees["tp"] == 1

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The data-parallel group an objective's metrics are summed over (None: one rank)."""
        return self.layout.group("dp") if self.layout.dp > 1 else None


@runtime_checkable
class Objective(Protocol):
    """What the one build path (``train/build.py``) needs of a ``train.objective``: its hooks, each given
    only what it reads. Registered under its name (:func:`register`, or the ``lmforge.objectives`` entry
    points)."""

    rows: int  # rows of a micro-batch per example (a preference pair: 2), for the tokens a step counts

    def check(self, cfg: Config) -> None:
        """What the objective refuses before any work (a ConfigError naming the key and the fix)."""
        ...

    def model_class(self, cfg: Config) -> type[Transformer]:
        """The network: ``Transformer`` or a subclass with the objective's heads, built as
        ``cls(cfg.model, vocab_size, seq_len, attention, moe_kernel)``."""
        ...

    def function(self, cfg: Config, model: Transformer) -> nn.Module:
        """The model and its loss, what ``parallel/apply.py`` transforms (called twice: the training
        function and evaluation's own)."""
        ...

    def module(self, parts: ModuleParts) -> TrainModule:
        """The training module (:class:`TrainModule`) over the built pieces."""
        ...

    def prepare(self, cfg: Config, layout: Layout, run_dir: Path | None) -> Any:
        """The run's data (anything with a ``tokenizer``), prepared on every rank (``layout``: which is
        the main one); ``run_dir``: where a report of it goes."""
        ...

    def loader(
        self, cfg: Config, data: Any, rank: int, world: int, run_dir: Path | None, accum: int
    ) -> TrainLoader:
        """The training loader of data-parallel rank ``rank`` of ``world``; ``accum``: micro-batches a
        step."""
        ...

    def validation(self, data: Any) -> TokenStream | None:
        """The validation token stream (None: the objective evaluates its own held-out data)."""
        ...


class LanguageModel:
    """``train.objective = "lm"``: the next-token loss on ``data.sources`` (tokenized into shards by
    ``data/prepare.py``, rank 0 first), read by the plain or mixture loader."""

    rows = 1

    def check(self, cfg: Config) -> None:
        input_files(cfg.data)  # missing inputs fail here
        check_domains(cfg.data)

    def model_class(self, cfg: Config) -> type[Transformer]:
        return Transformer

    def function(self, cfg: Config, model: Transformer) -> nn.Module:
        return NextTokenLoss(model, cfg.train.loss_chunk)

    def module(self, parts: ModuleParts) -> TrainModule:
        return LanguageModelModule(parts.model, parts.train_fn, parts.eval_fn, parts.sync, parts.whole)

    def prepare(self, cfg: Config, layout: Layout, run_dir: Path | None) -> PreparedData:
        return prepare_on_rank0(cfg, layout)

    def loader(
        self, cfg: Config, data: PreparedData, rank: int, world: int, run_dir: Path | None, accum: int
    ) -> TrainLoader:
        return build_train_loader(cfg, data, accum, rank, world)

    def validation(self, data: PreparedData) -> TokenStream:
        return TokenStream(data.val)


def prepare_on_rank0(cfg: Config, layout: Layout) -> PreparedData:
    """``prepare_data`` on rank 0 first (it may train a tokenizer and write shards), then on the others,
    which find its cache."""
    if not layout.distributed:
        return prepare_data(cfg.data)
    data = prepare_data(cfg.data) if layout.is_main else None
    dist.barrier()
    return data if data is not None else prepare_data(cfg.data)


ENTRY_POINTS = "lmforge.objectives"  # the entry-point group: NAME = "package.module:OBJECT"
_OBJECTIVES: dict[str, Objective] = {}


def register(name: str, objective: Objective) -> Objective:
    """Make ``objective`` the one of ``train.objective = name``; a name is registered once."""
    if not isinstance(objective, Objective):
        raise TypeError(f"objective {name!r}: {objective!r} lacks the hooks of train/modules.py::Objective")
    if _OBJECTIVES.setdefault(name, objective) is not objective:
        raise ValueError(f"objective {name!r} is registered already ({_OBJECTIVES[name]!r})")
    return objective


def registered() -> list[str]:
    """Every objective name known: registered, or offered by an installed package's entry point."""
    return sorted(set(_OBJECTIVES) | {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)})


def objective_for(cfg: Config) -> Objective:
    """The objective of ``cfg.train.objective``; an unregistered name is looked up once in the
    ``lmforge.objectives`` entry points (importing the module that defines it). A ConfigError naming the
    registered ones for a name none offers."""
    name = cfg.train.objective
    if name not in _OBJECTIVES:
        found = {ep.value: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS, name=name)}
        if len(found) > 1:
            raise ConfigError(f"train.objective: {name!r} is offered by several packages: {', '.join(found)}")
        if not found:
            raise ConfigError(
                f"train.objective: {name!r} is no registered objective; use one of {', '.join(registered())} "
                f"(a package adds one under the entry-point group {ENTRY_POINTS})"
            )
        register(name, next(iter(found.values())).load())
    return _OBJECTIVES[name]


register("lm", LanguageModel())
