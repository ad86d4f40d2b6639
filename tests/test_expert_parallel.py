"""Expert parallelism (``parallel.ep``, ``lmforge/parallel/expert.py``): refused layouts, and runs over
2 and 4 gloo ranks against one process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lmforge.config import check_moe
from lmforge.errors import ConfigError
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
        r"parallel\.ep: an expert group of 2 ranks would span pipeline stages": {
            **MOE,
            "parallel.ep": 2,
            "parallel.pp": 2,
        },
        r"parallel\.pp_schedule: zbv splits the backward": {
            **MOE,
            "parallel.pp": 2,
            "parallel.pp_schedule": "zbv",
        },
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
    # an expert group the pipeline stages would cut (the planner's one line: tests/test_moe_plan.py)
    layout = {**MOE, "parallel.ep": 2, "parallel.pp": 2}
    with pytest.raises(ConfigError, match="would span pipeline stages"):
        check_layout(load_config(None, layout), 2, {"WORLD_SIZE": "2", "RANK": "0"})


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


# -- MoE under pipeline and tensor parallelism -------------------------------------------------------------

# every balance term on, a shared expert, a dense first block (pp = 2: stage 0 holds blocks 0-1, one dense
# and one MoE; stage 1 blocks 2-3)
MOE_ALL = {
    **MOE,
    "model.moe.aux_loss": 0.01,
    "model.moe.seq_aux_loss": 0.01,
    "model.moe.z_loss": 0.001,
    "model.moe.shared_experts": 1,
    "model.moe.first_dense": 1,
}
MOE_STEPS = 4  # a few steps keep the four launches near a minute on 2 cores
# The pipeline runs each micro-batch of 4 rows as 2 microbatches of 2: every MoE forward (its balance
# losses, which are not linear in the tokens) sees 2 rows, as one process does with micro-batches of 2.
CHUNKED = {"train.micro_batch_size": 2}
MOE_LAYOUTS = {
    "pp2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "train.micro_batch_size": 4}, CHUNKED),
    "pp2-ep2": (
        4,
        {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.ep": 2, "train.micro_batch_size": 4},
        CHUNKED,
    ),
    "tp2": (2, {"parallel.tp": 2}, {}),
    "tp2-ep2": (4, {"parallel.dp_shard": 2, "parallel.tp": 2, "parallel.ep": 2}, {}),
}


@pytest.fixture(scope="module")
def one_process_moe(corpus_dir, tmp_path_factory):
    """The references of :data:`MOE_LAYOUTS`: one process, float64, 10 steps, by micro-batch size."""
    from tests.test_distributed import _overrides

    root, runs = tmp_path_factory.mktemp("moe-one"), {}

    def run(reference: dict) -> tuple:
        key = tuple(sorted(reference.items()))
        if key not in runs:
            over = _overrides(
                corpus_dir, root / "cache", **MOE_ALL, **reference, **{"train.steps": MOE_STEPS}
            )
            run_dir = root / f"run{len(runs)}"
            train(load_config(None, over), run_dir, progress_bar=False)
            runs[key] = run_dir, over
        return runs[key]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_moe_under_pipeline_and_tensor_parallel_equals_one_process(name, one_process_moe, tmp_path):
    """MoE blocks split over 2 pipeline stages (1F1B), with tensor parallelism, and each with expert
    parallelism: losses, gradient norms and parameters (1e-10, float64) of 4 steps, every step's expert
    load and the balancing bias equal one process's; with one data-parallel rank the balance losses too
    (with two, rank 0 reports those of its own micro-batches)."""
    from tests.test_distributed import assert_same_run, launch, losses

    nproc, layout, reference = MOE_LAYOUTS[name]
    ref, over = one_process_moe(reference)
    run = tmp_path / name
    launch(nproc, run, {**over, **layout})
    assert_same_run(run, ref, steps=range(1, MOE_STEPS + 1))
    for key in ("moe/layer.1/load", "moe/layer.3/load"):
        assert losses(run, key) == losses(ref, key)
    if layout.get("parallel.dp_shard", 1) == 1:
        for key in ("moe/aux_loss", "moe/seq_aux_loss", "moe/z_loss"):
            got, want = losses(run, key), losses(ref, key)
            # the same float64 sums; the pipeline gathers the layers' records: 1e-10 as for the losses
            assert len(got) == len(want) and all(got[s] == pytest.approx(want[s], rel=1e-10) for s in want)
    bias = [load_checkpoint(latest_checkpoint(r))["model"]["blocks.3.mlp.expert_bias"] for r in (run, ref)]
    assert bias[1].abs().sum() > 0 and torch.equal(bias[0], bias[1])
