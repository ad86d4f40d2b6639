"""Expert parallelism (``parallel.ep``, ``lmforge/parallel/expert.py``): refused layouts, and runs over
2 and 4 gloo ranks against one process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.model.moe import check_moe
from lmforge.parallel.layout import check_layout
from lmforge.recipe import load_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train

MOE = {
    "model.moe.experts": 4,
    "model.moe.top_k": 2,
    "model.moe.d_expert": 16,
    "model.moe.bias_update_rate": 0.01,
}


def test_bad_expert_parallel_layouts_are_refused_in_one_line(tmp_path):
    cases = {
        r"parallel\.ep: 3 does not divide model\.moe\.experts \(4\)": {**MOE, "parallel.ep": 3},
        r"parallel\.ep: 2 splits the experts of MoE layers, and this model has none": {"parallel.ep": 2},
        r"parallel\.ep: the expert groups .* parallel\.pp = 2": {**MOE, "parallel.ep": 2, "parallel.pp": 2},
    }
    for message, over in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_moe(load_config(None, over))
    layouts = {
        r"parallel\.ep: 4 expert-parallel ranks .* dp_replicate x dp_shard = 2": (
            {"parallel.ep": 4, "parallel.dp_shard": 2, "parallel.tp": 2},
            4,
        ),
        r"parallel\.zero: expert parallelism": (
            {"parallel.ep": 2, "parallel.dp_shard": 2, "parallel.zero": 1},
            2,
        ),
        r"parallel\.offload: expert parallelism": (
            {"parallel.ep": 2, "parallel.dp_shard": 2, "parallel.offload": True},
            2,
        ),
    }
    for message, (over, world) in layouts.items():
        with pytest.raises(ConfigError, match=message):
            check_layout(load_config(None, over), world, {"WORLD_SIZE": str(world), "RANK": "0"})
    args = ["--model.moe.experts=6", "--model.moe.top_k=2", "--parallel.ep=4"]
    r = subprocess.run(
        [sys.executable, "-m", "lmforge", "train", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "parallel.ep" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


EP_LAYOUTS = {
    "ep2": (2, {"parallel.dp_replicate": 2, "parallel.ep": 2}),
    "ep2-fsdp": (2, {"parallel.dp_shard": 2, "parallel.ep": 2}),
    "ep2-fsdp4": (4, {"parallel.dp_shard": 4, "parallel.ep": 2}),
    "ep4": (4, {"parallel.dp_replicate": 4, "parallel.ep": 4}),
    "ep4-fsdp": (4, {"parallel.dp_shard": 4, "parallel.ep": 4}),
}


@pytest.fixture(scope="module")
def one_process(corpus_dir, tmp_path_factory):
    """The reference: one process, float64 (tests/test_distributed.py's harness), 10 steps."""
    from tests.test_distributed import _overrides

    root = tmp_path_factory.mktemp("ep-one")
    over = _overrides(corpus_dir, root / "cache", **MOE)
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run", over


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_expert_parallel_run_equals_one_process(name, one_process, tmp_path):
    """Losses, gradient norms and every parameter (the experts gathered by DCP) of 10 steps equal one
    process's within 1e-10 (float64; the acceptance asks 1e-5), and each step's expert load too."""
    from tests.test_distributed import assert_same_run, launch, losses

    ref, over = one_process
    nproc, layout = EP_LAYOUTS[name]
    run = tmp_path / name
    done = launch(nproc, run, {**over, **layout})
    assert f"ep={layout['parallel.ep']}" in done.stdout + done.stderr  # the experts were split
    assert_same_run(run, ref)
    for key in ("moe/layer.0/load", "moe/layer.3/load"):
        assert losses(run, key) == losses(ref, key)
    bias = load_checkpoint(latest_checkpoint(run))["model"]["blocks.0.mlp.expert_bias"]
    assert bias.abs().sum() > 0 and torch.equal(
        bias, load_checkpoint(latest_checkpoint(ref))["model"]["blocks.0.mlp.expert_bias"]
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "first, second",
    [
        pytest.param(EP_LAYOUTS["ep4-fsdp"], EP_LAYOUTS["ep2-fsdp"], id="ep4_to_ep2"),
        pytest.param(EP_LAYOUTS["ep2"], (1, {}), id="ep2_to_one_process"),
    ],
)
def test_expert_parallel_resume_in_another_layout(first, second, one_process, tmp_path):
    """5 steps with one ``ep``, resumed to 10 with another (or in one process): DCP reshards the experts,
    and the run continues as one process's straight run (1e-10 in float64; the acceptance asks 1e-4)."""
    from tests.test_distributed import assert_same_run, launch

    ref, over = one_process
    run = tmp_path / "run"
    for (nproc, layout), steps, flags in ((first, 5, ()), (second, 10, ("--resume",))):
        step_over = {**over, **layout, "train.steps": steps}
        if nproc == 1:
            train(load_config(None, step_over), run, resume=True, progress_bar=False)
        else:
            done = launch(nproc, run, step_over, *flags)
            assert f"ep={layout['parallel.ep']}" in done.stdout + done.stderr  # the experts were split
    assert_same_run(run, ref)
