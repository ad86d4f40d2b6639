"""The global batch over a run (``train.batch_schedule``): how many micro-batches each optimizer step takes.

The micro-batch (``train.micro_batch_size`` sequences per rank) never changes, so memory does not either;
a step takes ``a`` micro-batches per data-parallel rank, ``a * m`` tokens with ``m = micro_batch_size *
seq_len * dp``, between ``a_0 = start_tokens_per_step / m`` and ``A = tokens_per_step / m``:

- ``constant``: ``a = A`` every step.
- ``ramp`` (the batch-size warmup of GPT-3 and Megatron's ``--rampup-batch-size``): ``a`` grows linearly in
  the tokens seen ``T``, one micro-batch at a time: :func:`ramp_accum`.
- ``noise`` (McCandlish et al. 2018: train near the critical batch, which grows as the loss falls): every
  ``interval`` steps ``a`` becomes ``k * B_simple / m`` (rounded down, never below the current ``a``, at
  most ``A``), ``B_simple`` the smoothed gradient noise scale in tokens (``optim/noise_scale.py``) measured
  from the first micro-batch and the whole step: :func:`noise_accum`.

The learning rate follows the batch by ``lr_rule`` (:func:`lr_factor`): linear scaling for SGD (Goyal et
al. 2017), square-root scaling for Adam-like optimizers (Malladi et al. 2022), or none; the configured
``optim.lr`` is the rate of the full batch.

The loader needs nothing: every micro-batch reads the next ``world * micro_batch_size`` sequence numbers
(``data/loader.py``), so its position after any run of steps is the sum of what they took, across changes
and resumes. The ramp is a pure function of the tokens seen (restored with the progress); the noise rule's
current ``a`` and its moving averages are :meth:`BatchSchedule.state_dict`.
"""

from __future__ import annotations

import math

import torch

from lmforge.config import BatchScheduleConfig, Config
from lmforge.errors import ConfigError
from lmforge.optim.noise_scale import NoiseScale

LR_POWER = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}


def ramp_accum(tokens_seen: int, start: int, full: int, ramp_tokens: int) -> int:
    """Micro-batches of a ramp step after ``tokens_seen`` tokens:
    ``min(A, a_0 + floor((A - a_0) * T / ramp_tokens))``."""
    return min(full, start + (full - start) * tokens_seen // ramp_tokens)


def noise_accum(b_simple: float, micro_tokens: int, current: int, full: int, multiple: float) -> int:
    """Micro-batches after a noise-rule decision: ``min(A, max(a, floor(k * B_simple / m)))``; ``a`` kept
    when ``B_simple`` is not a positive number (NaN: the noise dominated the estimate of ``|G|^2``)."""
    if not (b_simple > 0 and math.isfinite(b_simple)):
        return current
    return min(full, max(current, int(multiple * b_simple // micro_tokens)))


def lr_factor(accum: int, full: int, rule: str) -> float:
    """The learning rate's factor at ``a`` of ``A`` micro-batches: ``(a / A)^p``, ``p`` = 1 (linear), 1/2
    (sqrt) or 0 (none)."""
    return (accum / full) ** LR_POWER[rule]


def micro_tokens(cfg: Config) -> int:
    """Tokens of one micro-step over the data-parallel ranks: ``micro_batch_size * seq_len * dp``."""
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    return int(cfg.train.micro_batch_size) * cfg.data.seq_len * dp


def check_batch_schedule(cfg: Config, full_accum: int) -> int:
    """The first steps' micro-batches of ``train.batch_schedule`` (``A`` for a constant batch); a one-line
    :class:`ConfigError` for what the schedule cannot do: a start batch that is no multiple of a micro-step
    or not below the full batch, one micro-batch for the noise rule (it measures with two batch sizes),
    objectives and layouts whose step is not ``a`` micro-batches of sequences (post-training's pairs and
    rollouts, a pipeline's fixed micro-batch count), phases counted in steps, and layouts where the first
    micro-batch's gradient is not whole on each rank (noise rule)."""
    bs = cfg.train.batch_schedule
    if bs.name == "constant":
        return full_accum
    key = "train.batch_schedule"
    if cfg.train.objective not in ("lm", "sft"):
        raise ConfigError(f"{key}.name: {bs.name!r} changes the batch of lm and sft runs only; use constant")
    if cfg.parallel.pp > 1:
        raise ConfigError(f"{key}.name: a pipeline schedule has a fixed micro-batch count; use constant")
    if cfg.data.phases:
        raise ConfigError(
            f"{key}.name: data.phases end at step counts, which a changing batch moves; use one"
        )
    m = micro_tokens(cfg)
    start = bs.start_tokens_per_step or 0
    if start % m or not m <= start < full_accum * m:
        raise ConfigError(
            f"{key}.start_tokens_per_step: {start:,} is not a multiple of micro_batch_size x seq_len x dp = "
            f"{m:,} below train.tokens_per_step = {full_accum * m:,}; use e.g. {max(m, full_accum * m // 4):,}"
        )
    if bs.name == "noise":
        if start < 2 * m:
            raise ConfigError(
                f"{key}.start_tokens_per_step: the noise rule measures with two batch sizes, so a step needs "
                f"at least two micro-batches: use at least {2 * m:,}"
            )
        blocked = {
            "fsdp": cfg.parallel.dp_shard > 1,
            "tensor parallel": cfg.parallel.tp > 1,
            "expert parallel": cfg.parallel.ep > 1,
        }
        for name, on in blocked.items():
            if on:
                raise ConfigError(
                    f"{key}.name: the noise rule needs each rank's whole first-micro-batch gradient, which "
                    f"{name} splits; use ramp, or DDP (parallel.dp_replicate)"
                )
    return start // m


class BatchSchedule:
    """The current micro-batches per step ``accum`` and the rule that changes it (module docstring)."""

    def __init__(self, cfg: BatchScheduleConfig, start: int, full: int, micro_tokens: int):
        self.cfg, self.full, self.micro_tokens = cfg, full, micro_tokens
        self.accum = start
        self.start = start
        self.noise = NoiseScale()

    @property
    def measures(self) -> bool:
        """Whether the rule needs the gradient noise scale measured every step."""
        return self.cfg.name == "noise"

    def accum_at(self, tokens_seen: int) -> int:
        """Micro-batches per rank of the next step, after ``tokens_seen`` tokens."""
        if self.cfg.name == "ramp":
            self.accum = ramp_accum(tokens_seen, self.start, self.full, self.cfg.ramp_tokens)
        return self.accum

    def lr_factor(self) -> float:
        return lr_factor(self.accum, self.full, self.cfg.lr_rule)

    def observe(
        self, step: int, b_small: float, sq_small: torch.Tensor, b_big: float, sq_big: torch.Tensor
    ) -> None:
        """One step's two squared gradient norms into the averages; at every ``interval``-th step the
        noise rule's decision (:func:`noise_accum`)."""
        if b_big > b_small > 0:
            self.noise.update(b_small, sq_small, b_big, sq_big)
        if step % self.cfg.interval == 0 and self.noise.count:
            self.accum = noise_accum(
                self.noise.value(), self.micro_tokens, self.accum, self.full, self.cfg.noise_multiple
            )

    def state_dict(self) -> dict:
        """The rule, the current batch in tokens (a resume may change the micro-batch or the process count
        under the same global batch) and the noise rule's averages."""
        tokens = self.accum * self.micro_tokens
        return {"name": self.cfg.name, "tokens_per_step": tokens, "noise": self.noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The noise rule's batch and averages; nothing for the others (the ramp is a function of the tokens
        seen, a constant batch is the configured one) or when the saved rule was another one."""
        if self.cfg.name != "noise" or state.get("name") != "noise":
            return
        self.accum = min(self.full, max(self.start, int(state["tokens_per_step"]) // self.micro_tokens))
        self.noise.load_state_dict(state["noise"])
