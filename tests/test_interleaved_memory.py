"""The micro-batches an interleaved pipeline rank holds (``plan/estimate.py::interleaved_held``) against the
order torch's own schedules run their actions in.

The oracle is torch's schedule itself: ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``
compute each rank's list of forward and backward actions (``_calculate_single_rank_operations``, a
private method of torch 2.13: the object is made without stages, with only the attributes that method
reads). Walking that list, a forward adds one micro-batch to its local stage and a backward (whole, or
its input half under zero bubble) removes one; the holding is read as each backward starts, as the plan
reads it. Before, the plan held ``min(m, p - rank)`` micro-batches on every stage, 1F1B's count: the
measured interleaved case of the accuracy matrix was 28% above it.
"""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _ComputationType,
)

from lmforge.plan.estimate import interleaved_held

SCHEDULES = {
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "zero_bubble": (ScheduleInterleavedZeroBubble, 1),
}
SHAPES = [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 4), (2, 3, 6), (4, 3, 12), (2, 2, 2)]  # (p, v, m)
BACKWARD = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT)


def _actions(cls, p: int, v: int, m: int, rank: int) -> list:
    schedule = object.__new__(cls)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = p, v, m
    schedule.number_of_rounds = max(1, m // p)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    schedule.rank = rank
    return [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]


def _walk(actions: list, p: int, v: int, sizes: list[float], kept: list[float]) -> tuple[list[int], ...]:
    """The largest moments of the action list, as the plan reads them: at the start of each backward, the
    held micro-batches' ``sizes`` plus ``kept`` bytes per backward already finished (its sends, which
    torch's runtime schedules wait for only at the end of the step)."""
    held, done = [0] * v, [0] * v
    best, best_done, with_grads, with_grads_done = [0] * v, [0] * v, [0] * v, [0] * v

    def size(h: list[int], d: list[int]) -> float:
        return sum(n * b + f * k for n, b, f, k in zip(h, sizes, d, kept, strict=True))

    for action in actions:
        local = action.stage_index // p  # rank r holds stages r, r + p, r + 2p, ...
        if action.computation_type == _ComputationType.FORWARD:
            held[local] += 1
        elif action.computation_type in BACKWARD:
            if size(held, done) > size(best, best_done):
                best, best_done = list(held), list(done)
            if all(done) and size(held, done) > size(with_grads, with_grads_done):
                with_grads, with_grads_done = list(held), list(done)
            held[local] -= 1
            done[local] += 1
    return best, with_grads, best_done, with_grads_done


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("p", "v", "m"), SHAPES)
def test_held_micro_batches_follow_torchs_schedule(schedule: str, p: int, v: int, m: int):
    cls, factor = SCHEDULES[schedule]
    for rank in range(p):
        for sizes in ([1.0] * v, [3.0] + [1.0] * (v - 1), [1.0] * (v - 1) + [3.0]):
            for kept in ([0.0] * v, [0.5] * v, [0.0] + [2.0] * (v - 1)):
                want = _walk(_actions(cls, p, v, m, rank), p, v, sizes, kept)
                got = interleaved_held(p, v, m, rank, factor, sizes, kept)
                assert tuple(list(x) for x in got) == want, (rank, sizes, kept)
