"""The pipeline planner's figures: the action order of PyTorch's pipeline schedules on a time x rank grid,
its measured bubble and lmforge's formula beside it.

Where the order comes from (``torch.distributed.pipelining``, torch 2.13):

* multi-stage schedules (``interleaved_1f1b``, ``zero_bubble``, ``zbv``): their runtime executes the
  schedule's ``pipeline_order`` action by action, so the grid is
  ``_schedule_visualizer.get_schedule_ops(cls, pp, m, v, add_spacing=True)`` as it is.
* single-stage schedules (``gpipe``, ``1f1b``): their runtime is a hand-written loop
  (``_step_microbatches``); their ``pipeline_order`` is only a picture, and in torch 2.13 it cannot be spaced
  (it carries ``REDUCE_GRAD`` actions the spacer rejects, and ``Schedule1F1B``'s numbers the last rank's
  forwards 1..m instead of 0..m-1). So each rank's order is recorded from the schedule's own
  ``_step_microbatches`` run on a call-recording stage (``mock.create_autospec(PipelineStage)``, as
  torch's visualizer builds its stages): the forward / backward chunks it runs, in the order it runs
  them. Those orders are then placed in time by torch's own ``add_schedule_op_spacing``, which is what
  ``get_schedule_ops(add_spacing=True)`` does with a multi-stage order.

Time units: torch's spacer gives each action its visualizer width (forward 1, full backward 2, input
gradient 1, weight gradient 1: a backward costs about two forwards); a ``None`` is one idle unit.
"""

from __future__ import annotations

import contextlib
import io
from unittest import mock

from lmforge.parallel.pipeline import SCHEDULES, SINGLE_STAGE, bubble_fraction, check_pipeline

KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
LIMITS = {"pp": 16, "microbatches": 64, "stages_per_rank": 8}


def stages_per_rank_of(schedule: str, stages_per_rank: int) -> int:
    """Stages per rank a schedule runs: 1 for ``gpipe`` / ``1f1b``, the asked number (>= 2) otherwise."""
    return 1 if schedule in SINGLE_STAGE else stages_per_rank


def runtime_order(schedule: str, pp: int, microbatches: int) -> list[list]:
    """Each rank's compute actions (torch ``_Action``) in the order the single-stage schedule's
    ``_step_microbatches`` runs them (recorded from its calls to ``forward_one_chunk`` /
    ``backward_one_chunk``)."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    from torch.distributed.pipelining.stage import PipelineStage

    cls = SCHEDULES[schedule]
    orders = []
    for rank in range(pp):
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.num_stages, stage.stage_index = rank, pp, pp, rank
        stage.is_first, stage.is_last, stage.submod, stage.device = rank == 0, rank == pp - 1, None, "cpu"
        for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            getattr(stage, name).return_value = []
        ran: list = []
        stage.forward_one_chunk.side_effect = lambda i, *a, _r=rank, _o=ran, **k: _o.append(
            _Action(_r, _ComputationType.FORWARD, i)
        )
        stage.backward_one_chunk.side_effect = lambda i, *a, _r=rank, _o=ran, **k: _o.append(
            _Action(_r, _ComputationType.FULL_BACKWARD, i)
        )
        cls(stage, microbatches, loss_fn=None)._step_microbatches([()] * microbatches, [{}] * microbatches)
        orders.append(ran)
    return orders


def schedule_ops(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2) -> list[list]:
    """The spaced action grid of ``schedule`` (lmforge's name) for ``pp`` ranks and ``microbatches``:
    per rank, torch ``_Action`` or None (idle unit), as ``get_schedule_ops(..., add_spacing=True)``
    returns it (module docstring). ConfigError (one line) for settings lmforge's pipeline refuses."""
    from torch.distributed.pipelining._schedule_visualizer import add_schedule_op_spacing, get_schedule_ops

    v = stages_per_rank_of(schedule, stages_per_rank)
    for key, value in (("pp", pp), ("microbatches", microbatches), ("stages_per_rank", v)):
        if value > LIMITS[key]:
            raise ValueError(f"{key}: {value} is more than this page draws; give at most {LIMITS[key]}")
    check_pipeline(pp * v, pp, schedule, microbatches, None, v)
    with contextlib.redirect_stdout(io.StringIO()):  # the spacer prints every time step
        if schedule in SINGLE_STAGE:
            order = runtime_order(schedule, pp, microbatches)
            spaced = add_schedule_op_spacing(order)
        else:
            spaced = get_schedule_ops(SCHEDULES[schedule], pp, microbatches, v, add_spacing=True)
            order = get_schedule_ops(SCHEDULES[schedule], pp, microbatches, v)
            order = [[a for a in rank if a is not None] for rank in order]
    placed = [[a for a in rank if a is not None] for rank in spaced]
    if placed != order:  # the spacer re-indexes ranks once one finishes early; refuse a shuffled picture
        raise ValueError(f"schedule: torch's spacer misplaced the actions of {schedule}; try other settings")
    return spaced


def width(action) -> int:
    """Time units of one action on the grid (torch's visualizer widths: F 1, B 2, I 1, W 1)."""
    from torch.distributed.pipelining._schedule_visualizer import action_type_to_color_mapping

    return action_type_to_color_mapping[action.computation_type].width


def measured_bubble(cells: list[list[dict]], pp: int) -> tuple[int, int, float]:
    """``(busy units, makespan, idle / all)`` of a placed grid: every rank's timeline lasts the makespan
    (the end of the last action on any rank); idle = ``pp * makespan - busy``."""
    makespan = max((c["start"] + c["width"] for rank in cells for c in rank), default=0)
    busy = sum(c["width"] for rank in cells for c in rank)
    return busy, makespan, (pp * makespan - busy) / (pp * makespan) if makespan else 0.0


def pipeline_figures(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 2) -> dict:
    """Everything the pipeline page draws: the spaced grid as torch's action strings (``ops``), each
    action placed in time units (``cells``), the measured bubble and ``bubble_fraction(p, m, v)``."""
    v = stages_per_rank_of(schedule, stages_per_rank)
    spaced = schedule_ops(schedule, pp, microbatches, v)
    cells: list[list[dict]] = []
    for rank in spaced:
        t, row = 0, []
        for a in rank:
            if a is None:
                t += 1
                continue
            w = width(a)
            row.append(
                {
                    "start": t,
                    "width": w,
                    "stage": a.stage_index,
                    "kind": KIND.get(a.computation_type.name, a.computation_type.name),
                    "mb": a.microbatch_index,
                    "label": str(a),
                }
            )
            t += w
        cells.append(row)
    busy, makespan, bubble = measured_bubble(cells, pp)
    return {
        "schedule": schedule,
        "torch_class": SCHEDULES[schedule].__name__,
        "pp": pp,
        "microbatches": microbatches,
        "stages_per_rank": v,
        "n_stages": pp * v,
        "ops": [[None if a is None else str(a) for a in rank] for rank in spaced],
        "cells": cells,
        "busy_units": busy,
        "makespan": makespan,
        "idle_units": pp * makespan - busy,
        "bubble_measured": bubble,
        "bubble_formula": bubble_fraction(pp, microbatches, v),
        "source": "recorded _step_microbatches" if schedule in SINGLE_STAGE else "pipeline_order",
    }
