"""The one build path: a resolved config -> everything a run needs.

Every command that trains, probes or evaluates a model (``train``, ``lr-find``, ``mup-check``, ``eval``,
``generate``, the benchmarks) builds it here, so they agree with training by construction:

* :func:`validate` checks what can be checked before any work (accumulation, inputs, domains, device);
* :func:`build_model` builds the plain model on the meta device, materialises it on the run's device
  and initialises it from the seed (or leaves it for a checkpoint to fill);
* :func:`build_run` adds the precision policy, the training objective with the model transformations of
  ``lmforge.parallel.apply`` in their fixed order, the optimizer with its groups, the schedule, the
  clipper, the training loader (plain or mixture, one protocol) and the validation stream.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.config import Config
from lmforge.data.loader import TokenStream, TrainLoader
from lmforge.data.mixture import build_train_loader, check_domains
from lmforge.data.prepare import PreparedData, input_files, prepare_data
from lmforge.errors import ConfigError
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.optim.schedules import Schedule
from lmforge.parallel.apply import ApplyContext, apply, can_compile
from lmforge.precision import PrecisionPolicy
from lmforge.train.runtime import configure_determinism, pick_device, seed_all

log = logging.getLogger(__name__)


def accumulation_steps(cfg: Config, world: int = 1) -> int:
    """Micro-batches per optimizer step: ``tokens_per_step / (micro_batch_size * seq_len * world)``."""
    per_micro = cfg.train.micro_batch_size * cfg.data.seq_len * world
    tokens = cfg.train.tokens_per_step or per_micro
    if tokens % per_micro:
        raise ConfigError(
            f"train.tokens_per_step: {tokens} is not a multiple of micro_batch_size * seq_len * world "
            f"= {per_micro}; use a multiple such as {max(1, round(tokens / per_micro)) * per_micro}"
        )
    return tokens // per_micro


def validate(cfg: Config) -> torch.device:
    """Everything checkable before work starts (user errors raise); returns the run's device."""
    accumulation_steps(cfg)
    input_files(cfg.data)  # missing inputs fail here
    check_domains(cfg.data)
    return pick_device(cfg.train.device)


def build_model(cfg: Config, vocab_size: int, device: torch.device, init: bool = True) -> Transformer:
    """The plain model of ``cfg``: built on the meta device (no memory, no init work), materialised on
    ``device``, then initialised from ``train.seed`` (``init=False``: left for a checkpoint to fill)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, vocab_size, cfg.data.seq_len, attention=cfg.train.attention)
    model.materialize(device)
    if init:
        seed_all(cfg.train.seed)
        model.init_weights()
    return model


def training_objective(model: Transformer, cfg: Config, device: torch.device) -> nn.Module:
    """The model and its loss, with the model transformations applied in their fixed order."""
    return apply(NextTokenLoss(model, cfg.train.loss_chunk), ApplyContext(cfg.train, device))


@dataclass
class Run:
    """Everything a training run (or a probe of one) needs, built from one config."""

    cfg: Config
    device: torch.device
    precision: PrecisionPolicy
    data: PreparedData
    model: Transformer  # the plain model: parameters, state_dict, sampling
    objective: nn.Module  # what a training step calls: model + loss, transformed (compiled, ...)
    eval_objective: nn.Module  # model + loss, eager (evaluation is too rare to pay for a second graph)
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    clipper: Clipper
    loader: TrainLoader
    val: TokenStream
    accum: int  # micro-batches per optimizer step

    @property
    def tokens_per_step(self) -> int:
        return self.accum * self.cfg.train.micro_batch_size * self.cfg.data.seq_len


def build_run(cfg: Config, data: PreparedData | None = None) -> Run:
    """Build every part of a run of ``cfg`` (``data``: already prepared data, else prepared here)."""
    device = validate(cfg)
    accum = accumulation_steps(cfg)
    configure_determinism(cfg.train.deterministic)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    data = data if data is not None else prepare_data(cfg.data)
    model = build_model(cfg, data.tokenizer.vocab_size, device)
    optimizer = build_optimizer(model, cfg.optim, device, compile=can_compile(cfg.train.compile, device))
    log.info(
        "model: %s, %.2fM parameters; %d micro-batches of %d x %d per step",
        cfg.model.arch,
        model.num_params(False) / 1e6,
        accum,
        cfg.train.micro_batch_size,
        cfg.data.seq_len,
    )
    return Run(
        cfg=cfg,
        device=device,
        precision=precision,
        data=data,
        model=model,
        objective=training_objective(model, cfg, device),
        eval_objective=NextTokenLoss(model, cfg.train.loss_chunk),
        optimizer=optimizer,
        schedule=Schedule(cfg.schedule, cfg.train.steps),
        clipper=Clipper.from_config(cfg.train),
        loader=build_train_loader(cfg, data, accum),
        val=TokenStream(data.val),
        accum=accum,
    )
