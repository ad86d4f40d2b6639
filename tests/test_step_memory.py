"""``probes/step_memory.py``, the measurement the planner's accuracy matrix is held to, against figures
taken from outside it: the parameters row is the model's parameter and buffer bytes as torch reports them,
the optimizer-states row is ``optim/state_size.py::state_bytes`` of the run's optimizer after the step."""

from __future__ import annotations

import torch

from lmforge.optim.state_size import state_bytes
from lmforge.probes.step_memory import measure_step
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from tests.conftest import tiny_overrides


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_one_process_step_rows_match_the_model_and_the_optimizer(corpus_dir, tmp_path):
    torch.manual_seed(0)
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {"model.arch": "llama", "model.n_kv_heads": 2}
    run = build_run(load_config(None, over))
    m = measure_step(run)
    rows = m.rows()
    assert rows["parameters"] == _bytes(run.model.parameters()) + _bytes(run.model.buffers())
    assert rows["optimizer states"] == state_bytes(run.optimizer) > 0
    # at the peak some activations or gradients are alive, and the categories add up to the total
    assert rows["activations"] + rows["gradients"] > 0
    assert sum(m.categories.values()) == m.total


def test_a_step_of_two_micro_batches_is_measured(corpus_dir, tmp_path):
    """Gradient accumulation: the tracker sees the model's forward twice in one step (it refuses that
    unless its module statistics are cleared between micro-batches); the gradients of the step exist."""
    torch.manual_seed(0)
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {"train.tokens_per_step": 2 * 4 * 32}
    run = build_run(load_config(None, over))
    assert run.accum == 2
    rows = measure_step(run).rows()
    assert rows["parameters"] == _bytes(run.model.parameters()) + _bytes(run.model.buffers())
    assert rows["optimizer states"] == state_bytes(run.optimizer)


def test_the_plain_storage_count_equals_the_tracker_on_the_same_step(corpus_dir, tmp_path):
    """``StoragePeak`` (for the zero-bubble schedules, whose split backward the tracker's module hooks
    cannot follow) counts what ``MemTracker`` counts: the same run's next step, to the byte."""
    from lmforge.probes.step_memory import _measure_plainly

    torch.manual_seed(0)
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {"model.arch": "gpt2", "optim.name": "lion"}
    run = build_run(load_config(None, over))
    tracked = measure_step(run)
    plain = _measure_plainly(run)
    assert plain.total == tracked.total > 0
    assert plain.states == tracked.states
