"""The micro-batch sizes ``train.micro_batch_size = "auto"`` chooses among: pure arithmetic shared by
``lmforge train`` (``probes/auto_batch.py``, which asks the planner which of them fits this run's device)
and ``lmforge estimate`` (``plan/request.py``)."""

from __future__ import annotations

from collections.abc import Callable

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.parallel.pipeline import pipeline_settings


def candidates(tokens_per_step: int, seq_len: int, dp: int, multiple_of: int = 1) -> list[int]:
    """Micro-batch sizes that split a step evenly, largest first: the divisors ``m`` of
    ``tokens_per_step / (seq_len * dp)`` with ``m % multiple_of == 0``."""
    per_rank, rest = divmod(tokens_per_step, seq_len * dp)
    if rest or per_rank == 0:
        raise ConfigError(
            f"train.tokens_per_step: {tokens_per_step} is not a multiple of seq_len * data-parallel ranks "
            f"= {seq_len * dp}; use a multiple such as {max(1, per_rank) * seq_len * dp}"
        )
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0 and m % multiple_of == 0]


def largest(sizes: list[int], fits: Callable[[int], bool]) -> int | None:
    """The first of ``sizes`` (largest first) for which ``fits`` holds; None when none does."""
    return next((m for m in sizes if fits(m)), None)


def auto_candidates(cfg: Config) -> list[int]:
    """The micro-batch sizes ``auto`` chooses among for ``cfg`` (largest first); one-line errors when
    ``train.tokens_per_step`` is missing or no size splits it."""
    if cfg.train.tokens_per_step is None:
        raise ConfigError(
            'train.micro_batch_size: "auto" keeps train.tokens_per_step and picks the accumulation; set '
            "train.tokens_per_step too (e.g. --train.tokens_per_step=65536)"
        )
    p = cfg.parallel
    m = pipeline_settings(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank)[0] if p.pp > 1 else 1
    sizes = candidates(cfg.train.tokens_per_step, cfg.data.seq_len, p.dp_replicate * p.dp_shard, m)
    if not sizes:
        raise ConfigError(
            f"train.micro_batch_size: no micro-batch size splits train.tokens_per_step into whole micro-batches "
            f"of a multiple of the {m} pipeline micro-batches; raise train.tokens_per_step"
        )
    return sizes
