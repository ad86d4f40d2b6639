"""Process layouts refused before any work, and checkpoints written in the background."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.parallel.layout import check_layout, data_parallel_kind
from lmforge.parallel.model_layout import check_compiled_layout, check_model_layout
from lmforge.recipe import load_config
from lmforge.train.build import validate
from lmforge.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

TORCHRUN = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}


def _cfg(**parallel):
    return load_config(None, {f"parallel.{k}": v for k, v in parallel.items()})


@pytest.mark.parametrize(
    "parallel, world, env, key, words",
    [
        ({"dp_shard": 2}, 1, {}, "parallel:", "torchrun --nproc-per-node=2"),
        ({}, 4, TORCHRUN, "parallel:", "--parallel.dp_shard=4"),
        ({"dp_shard": 2, "tp": 3}, 4, TORCHRUN, "parallel:", "uses 6"),
        ({"dp_replicate": 2, "tp": 2}, 4, TORCHRUN, "parallel.tp:", "FSDP2 only"),
        ({"dp_replicate": 4, "offload": True}, 4, TORCHRUN, "parallel.offload:", "dp_shard"),
        ({"dp_shard": 2, "zero": 1, "pp": 2}, 4, TORCHRUN, "parallel.zero:", "pipeline"),
        ({"dp_replicate": 2, "pp": 2}, 4, TORCHRUN, "parallel.dp_replicate:", "pipeline"),
        ({}, 1, {"SLURM_NTASKS": "4"}, "lmforge train:", "srun without torchrun"),
        # defer_grad_sync defers FSDP2's reduce-scatters: meaningless for one process, DDP, ZeRO-1, a pipeline
        ({"defer_grad_sync": True}, 1, {}, "parallel.defer_grad_sync:", "dp_shard above 1"),
        (
            {"dp_replicate": 4, "defer_grad_sync": True},
            4,
            TORCHRUN,
            "parallel.defer_grad_sync:",
            "zero=2 or 3",
        ),
        (
            {"dp_shard": 4, "zero": 1, "defer_grad_sync": True},
            4,
            TORCHRUN,
            "parallel.defer_grad_sync:",
            "ZeRO-1",
        ),
        (
            {"dp_shard": 2, "pp": 2, "defer_grad_sync": True},
            4,
            TORCHRUN,
            "parallel.defer_grad_sync:",
            "pipeline",
        ),
    ],
)
def test_wrong_layouts_are_refused_in_one_line(parallel, world, env, key, words):
    with pytest.raises(UserError) as err:
        check_layout(_cfg(**parallel), world, env)
    text = str(err.value)
    assert text.startswith(key) and words in text and "\n" not in text


def test_layouts_name_their_machinery():
    assert data_parallel_kind(_cfg()) == "none"
    assert data_parallel_kind(_cfg(dp_replicate=2)) == "ddp"
    assert data_parallel_kind(_cfg(dp_shard=2, zero=1)) == "zero1"
    assert data_parallel_kind(_cfg(dp_shard=2, zero=2)) == "fsdp"
    check_layout(_cfg(dp_replicate=2, dp_shard=2, tp=2, pp=1), 8, {**TORCHRUN, "WORLD_SIZE": "8"})
    for zero in (2, 3):  # FSDP2, also with tensor parallelism and hybrid sharding
        deferred = _cfg(dp_replicate=2, dp_shard=2, tp=2, zero=zero, defer_grad_sync=True)
        check_layout(deferred, 8, {**TORCHRUN, "WORLD_SIZE": "8"})


@pytest.mark.parametrize(
    "over, key",
    [
        ({"parallel.tp": 3}, "parallel.tp:"),  # 4 heads do not split 3 ways
        ({"parallel.pp": 8, "model.tie_embeddings": False}, "parallel.pp:"),  # 8 stages, 2 layers
        (
            {"parallel.pp": 2, "model.tie_embeddings": False, "train.clip_mode": "group_norm"},
            "train.clip_mode:",
        ),
        (  # selective checkpointing refuses the second backward of the split schedules (seen in a run)
            {
                "parallel.pp": 2,
                "parallel.pp_schedule": "zero_bubble",
                "model.n_layers": 4,
                "model.tie_embeddings": False,
                "train.activation_checkpointing": "selective",
            },
            "train.activation_checkpointing:",
        ),
        # the split backward of the zero-bubble schedules under FSDP2 trains other weights, under TP fails
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "zbv", "parallel.dp_shard": 2, "model.n_layers": 4},
            "parallel.dp_shard:",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "zero_bubble", "parallel.tp": 2, "model.n_layers": 4},
            "parallel.tp:",
        ),
        # a pipeline cannot run an objective over whole sequences: named before the microbatch checks
        (
            {"parallel.pp": 2, "train.objective": "rl", "rl.algorithm": "ppo", "train.micro_batch_size": 1},
            "parallel.pp: not with train.objective = rl (rl.algorithm = ppo)",
        ),
    ],
)
def test_model_must_divide_as_the_layout_cuts_it(over, key):
    cfg = load_config(None, {"model.n_layers": 2, "model.n_heads": 4, "model.d_model": 32, **over})
    with pytest.raises(UserError) as err:
        check_model_layout(cfg)
    assert str(err.value).startswith(key)


def test_compiled_tensor_parallel_blocks_are_refused_on_a_cpu_and_planned_anywhere():
    """The run refuses what the distributed matrix saw fail (compiled TP blocks' backward, CPU, torch 2.13)
    by both keys; the planner's layout check, which plans for other machines, does not."""
    cfg = load_config(None, {"model.n_layers": 2, "model.n_heads": 4, "model.d_model": 32, "parallel.tp": 2})
    assert cfg.train.compile  # the default
    check_model_layout(cfg)
    with pytest.raises(UserError, match=r"^train\.compile: not with parallel\.tp = 2 on a CPU"):
        check_compiled_layout(cfg, torch.device("cpu"))
    check_compiled_layout(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": False})}), torch.device("cpu")
    )


def test_offload_needs_an_accelerator(tiny_config):
    cfg = tiny_config.model_copy(deep=True)
    cfg.train.device = "cpu"
    cfg.parallel.offload = True
    with pytest.raises(UserError, match=r"^parallel\.offload: .*CUDA"):
        validate(cfg)


def test_cli_layout_without_torchrun_exits_2_before_work(tmp_path, capsys, cli_logging):
    with pytest.raises(SystemExit) as done:
        main(["train", "--run-dir", str(tmp_path / "run"), "--parallel.dp_shard=2"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lmforge train: error: parallel:") and "torchrun" in err[-1]
    assert not (tmp_path / "run").exists()


def test_async_checkpoint_overlaps_training_and_writes_the_same_state(corpus_dir, tmp_path):
    over = {
        **tiny_overrides(corpus_dir, tmp_path / "data"),
        "train.steps": 12,
        "train.checkpoint_interval": 4,
    }
    over.update({"train.keep_checkpoints": 5, "train.sample_tokens": 0, "train.eval_interval": 0})
    train(load_config(None, over), tmp_path / "sync", progress_bar=False)
    train(load_config(None, {**over, "train.async_checkpoint": True}), tmp_path / "async", progress_bar=False)
    lines = [json.loads(x) for x in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    done = [x for x in lines if x.get("event") == "checkpoint"]
    assert [x["step"] for x in done] == [4, 8]  # the interval checkpoints went to the background ...
    assert all(x["completed_during_step"] > x["step"] for x in done)  # ... and training went on meanwhile
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == [
        p.name for p in list_checkpoints(tmp_path / "sync")
    ]
    for a, b in zip(list_checkpoints(tmp_path / "async"), list_checkpoints(tmp_path / "sync"), strict=True):
        sa, sb = load_checkpoint(a), load_checkpoint(b)
        assert all(torch.equal(v, sb["model"][k]) for k, v in sa["model"].items())
    assert not list((tmp_path / "async" / "checkpoints").glob("*.tmp"))
    assert latest_checkpoint(tmp_path / "async").name == "step_00000012"


def test_resume_of_an_old_format_checkpoint_says_so(tmp_path, tiny_config):
    old = tmp_path / "run" / "checkpoints" / "step_00000010"
    old.mkdir(parents=True)
    (old / "state.pt").write_bytes(b"an earlier format")
    with pytest.raises(UserError, match="earlier lmforge"):
        train(tiny_config, tmp_path / "run", resume=True, progress_bar=False)
