"""``lmforge rl`` under FSDP2 (``parallel.dp_shard = 2``) and tensor parallelism (``parallel.tp = 2``), two
processes, gloo, trains as one process does: the same rollouts, rewards (a reward-model run,
``rl.reward = "run:PATH"``), losses and weights, in float64; PPO (its value head, GAE and whitening per
micro-batch) the same under FSDP2 and tensor parallelism; an MoE policy the same under expert parallelism
with FSDP2 (``parallel.ep = 2``, ``dp_shard = 2``). The run folder is started in one process
(``--prepare-only`` equivalent), then resumed under torchrun; the one-process run takes the same 4 prompts
a step as 2 micro-batches of 2. The layouts RL does not run (pipeline parallelism, offload) are refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from lmforge.parallel.model_layout import check_model_layout
from lmforge.posttrain.finetune import start
from lmforge.posttrain.run import check_rl
from lmforge.recipe import load_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides
from tests.test_reward import reward_overrides
from tests.test_rl_runs import _prompts, pretrained  # noqa: F401 (fixture)
from tests.torchrun import torchrun


def _records(run) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x for x in lines if "loss" in x}


def _rl_run(tmp_path: Path) -> dict:
    """What every layout test here trains: 8 prompts, 2 held out, completions of at most 6 tokens, 3
    float64 steps of 4 prompts (2 micro-batches of 2 in one process, 1 a rank under FSDP2), every step
    logged, a checkpoint at the end."""
    seq_len = 64
    return {
        "posttrain.train_files": [_prompts(tmp_path / "p.jsonl", [f"def f{i}(x):" for i in range(8)])],
        "posttrain.val_files": [_prompts(tmp_path / "v.jsonl", ["class A:", "import os"])],
        "rl.max_new_tokens": 6,
        "train.steps": 3,
        "train.micro_batch_size": 2,
        "train.tokens_per_step": 4 * seq_len,  # 4 prompts a step: 2 micro-batches here, 1 a rank there
        "train.precision": "fp64",
        "train.compile": False,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 3,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "optim.lr": 3e-3,
        "schedule.warmup": 1,
    }


LAYOUTS = {
    "2 processes: dp_shard=2 (FSDP2, ZeRO-3)": {"parallel.dp_shard": 2},
    "2 processes: tp=2": {"parallel.tp": 2},
}


def _each_layout_equals_one_process(
    base: Path, tmp_path: Path, over: dict, single: dict, keys: tuple[str, ...], rel: float, abs_: float
) -> None:
    """Each of :data:`LAYOUTS` over 2 processes, started from the run ``base``, against the one-process
    run in ``tmp_path / "one"`` (summary ``single``): the step records' ``keys`` and the greedy held-out
    reward within ``rel`` / ``abs_``, the weights (the same names) within 1e-11 (the callers say where
    the bounds come from)."""
    want = _records(tmp_path / "one")
    a = load_checkpoint(latest_checkpoint(tmp_path / "one"))["model"]
    for i, (described, layout) in enumerate(LAYOUTS.items()):
        run = tmp_path / f"two{i}"
        start("rl", base, run, overrides={**over, **layout})
        done = torchrun(2, ["-m", "lmforge", "rl", "--resume", "--run-dir", str(run)])
        assert done.returncode == 0, done.stderr[-4000:]
        got = _records(run)
        assert sorted(got) == [1, 2, 3]
        for step in want:
            for key in keys:
                # rel / abs_: the callers' bounds, each derived where it is passed (float64 runs)
                assert got[step][key] == pytest.approx(want[step][key], rel=rel, abs=abs_), (i, step, key)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["layout"] == described
        # rel: the callers' bound too (a float64 reward of greedy completions)
        assert summary["val_reward"] == pytest.approx(single["val_reward"], rel=rel)  # greedy, gathered copy
        b = load_checkpoint(latest_checkpoint(run))["model"]
        assert a.keys() == b.keys()
        # 1e-11: the weights' bound, derived in the callers (Adam-grown float64 rounding)
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-11, described


@pytest.mark.distributed
def test_rl_trains_like_one_process_under_fsdp2_and_tensor_parallelism(pretrained, tmp_path):  # noqa: F811
    # an untrained reward head on the base (step 0 of lmforge reward): a reward any completion gets a spread of
    start("reward", pretrained, tmp_path / "rm", overrides=reward_overrides(tmp_path, 1))
    over = _rl_run(tmp_path) | {
        "rl.reward": f"run:{tmp_path / 'rm'}",
        "rl.group_size": 4,
        "rl.loss": "dapo",  # a token-level mean: a loss value that is not 0 at ratio 1 (grpo's would be)
    }
    one = tmp_path / "one"
    cfg, _ = start("rl", pretrained, one, overrides=over)
    single = train(cfg, one, resume=True, progress_bar=False)
    want = _records(one)
    assert sorted(want) == [1, 2, 3]
    assert want[3]["rl/kl"] > 0 and want[1]["loss"] != 0  # the policy moved; the loss is not trivially 0
    # float64 throughout (weights, log-probabilities, losses, gradient reductions): FSDP2 differs from one
    # process at most in how two micro-batches' gradients are summed, tensor parallelism also in how each
    # row-parallel matmul and the vocabulary-parallel softmax split their sums: a relative 2^-53 ~ 1e-16
    # per operation, which 3 Adam steps carry into the next rollouts' losses at about that size
    # (measured on 2 CPU cores: FSDP2 bitwise equal, TP 1.4e-15 relative at most). 1e-9 is that with
    # ample room, and 60x below one FP32 rounding (6e-8): an FP32 step, a gradient left unreduced or one
    # other sampled token would exceed it. The weights: Adam divides each element's gradient by
    # sqrt(v) + eps, so the 1e-16 rounding differences of small gradients grow (measured: FSDP2 1.4e-17,
    # TP 1.6e-14 on weights of ~0.09; 2.4e-14 with another reward); 1e-11 is 400x that and 20x below what
    # one FP32 rounding of a gradient moves a weight (lr 3e-3 x 6e-8). FSDP2: each rank 1 micro-batch of
    # the step's 2; TP: both ranks the step's 2 micro-batches, each holding half of every head, MLP and
    # the vocabulary; the first rank samples and scores, the second gets its rows.
    keys = ("loss", "rl/reward_mean", "rl/kl", "rl/entropy", "rl/response_length")
    # rel=1e-9 and the weights' 1e-11: the derivation above; abs_=1e-12: a floor for records at or near 0,
    # where a relative bound means nothing: ~1e4 float64 roundings (1.1e-16) of terms of order 1
    _each_layout_equals_one_process(pretrained, tmp_path, over, single, keys, rel=1e-9, abs_=1e-12)


@pytest.mark.parametrize(
    ("over", "named"),
    [
        ({"parallel.pp": 2}, "parallel.pp"),
        ({"parallel.dp_shard": 2, "parallel.offload": True}, "parallel.offload"),
    ],
)
def test_layouts_rl_does_not_run_are_refused_by_name(over, named):
    cfg = load_config(
        None, {"train.objective": "rl", "train.micro_batch_size": 2, "data.seq_len": 64, **over}
    )
    with pytest.raises(ConfigError, match=rf"^{named}: .*(lmforge rl|train.objective = rl)"):
        check_model_layout(cfg)  # validate's order: the layout's refusals (a pipeline), then the objective's
        check_rl(cfg)
    for ok in (
        {"parallel.dp_shard": 2},
        {"parallel.tp": 2},
        {"rl.algorithm": "ppo", "parallel.dp_replicate": 2},
        {"parallel.dp_shard": 2, "parallel.ep": 2, "model.moe.experts": 4},
    ):
        check_rl(load_config(None, {"train.micro_batch_size": 2, "data.seq_len": 64, **ok}))


@pytest.mark.distributed
def test_ppo_trains_like_one_process_under_fsdp2_and_tensor_parallelism(pretrained, tmp_path):  # noqa: F811
    # PPO's value head is one more parameter of the model: FSDP2 shards it with the root, tensor
    # parallelism replicates it, and the whole copy RL samples from holds it too (unused by sampling).
    # (DDP's reducer averages its gradient: DDP and ZeRO-1 in this test, run by hand, were bitwise equal
    # to one process; left out to keep the test's time down.) GAE and whitening run per micro-batch, and
    # each rank's micro-batches are those one process takes in turn, so 2 ranks of 1 micro-batch a step
    # are the one-process run of 2 micro-batches a step (under TP both ranks take both micro-batches).
    over = _rl_run(tmp_path) | {
        "rl.algorithm": "ppo",
        "rl.reward": "tests.rl_rewards:length",
        "rl.reward_workers": 1,  # one sandbox process a rank: less to start in each of the 3 runs
        "rl.group_size": 2,
        "rl.beta": 0.05,  # the KL penalty in the per-token rewards: the reference's path is exercised too
    }
    one = tmp_path / "one"
    cfg, _ = start("rl", pretrained, one, overrides=over)
    single = train(cfg, one, resume=True, progress_bar=False)
    want = _records(one)
    assert sorted(want) == [1, 2, 3] and want[3]["rl/kl"] > 0 and want[1]["rl/value_loss"] > 0
    assert "value_head.weight" in load_checkpoint(latest_checkpoint(one))["model"]
    # float64 throughout: FSDP2 differs from one process at most in how two micro-batches' gradients
    # are summed, TP also in how its matmuls and softmax split their sums (a relative 2^-53 ~ 1.1e-16
    # per operation), which 3 Adam steps of lr 3e-3 carry into the next rollouts' values,
    # log-probabilities and losses at about that relative size (measured on 2 CPU cores: FSDP2 bitwise
    # equal, TP 3.7e-14 at most). 1e-10 leaves a factor 1e3 for the amplification through Adam's
    # division by sqrt(v) and the whitening's by the advantages' std, and is 600x below one FP32
    # rounding (6e-8): an FP32 step, a value head left unsynchronised, whitening over other rows or one
    # other sampled token would exceed it. The weights as in the test above (measured: 0 for FSDP2,
    # 1.8e-14 for TP), the value head among them.
    keys = ("loss", "rl/reward_mean", "rl/kl", "rl/value_loss", "rl/explained_variance")
    # rel=1e-10: the derivation above; abs_=1e-13: a floor for records at or near 0, ~1e3 float64
    # roundings (1.1e-16) of terms of order 1
    _each_layout_equals_one_process(pretrained, tmp_path, over, single, keys, rel=1e-10, abs_=1e-13)


def test_rollout_rows_are_padded_to_a_multiple_of_the_tensor_parallel_degree():
    import torch

    from lmforge.posttrain.rl_data import rollout_rows

    # prompt [5, 6] + completion [7, 8, 9] and prompt [5] + completion [7]: the longest row is 5 ids, 4
    # positions of inputs and shifted targets, padded to 6 for a multiple of 3 (written out by hand)
    inputs, targets, docs = rollout_rows([[5, 6], [5]], [[7, 8, 9], [7]], pad_id=0, multiple=3)
    assert inputs.tolist() == [[5, 6, 7, 8, 0, 0], [5, 0, 0, 0, 0, 0]]
    assert targets.tolist() == [[-100, 7, 8, 9, -100, -100], [7, -100, -100, -100, -100, -100]]
    assert docs.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert torch.equal(rollout_rows([[5, 6], [5]], [[7, 8, 9], [7]], 0)[0], inputs[:, :4])  # multiple 1


@pytest.fixture(scope="module")
def pretrained_moe(corpus_dir, tmp_path_factory):
    """A tiny MoE run (4 experts, top 2, the Switch balance loss on; 2 steps of the tiny recipe)."""
    root = tmp_path_factory.mktemp("pre_moe")
    over = {
        **tiny_overrides(corpus_dir, root / "data"),
        **{"train.sample_tokens": 0, "data.seq_len": 64, "train.steps": 2, "train.eval_interval": 0},
        **{
            "model.moe.experts": 4,
            "model.moe.top_k": 2,
            "model.moe.d_expert": 16,
            "model.moe.aux_loss": 0.01,
        },
    }
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


@pytest.mark.distributed
def test_rl_with_an_moe_policy_trains_like_one_process_under_expert_parallelism(pretrained_moe, tmp_path):
    # each rank holds 2 of the 4 experts of both MoE layers and routes its own micro-batch, whose rows
    # go to the experts' ranks and back (all-to-all); FSDP2 shards the dense weights. Sampling runs on a
    # whole copy gathered from both kinds of shard. (DDP with ep = 2, dp_replicate = 2, and PPO under
    # both, run by hand the same way: within 1.2e-15 of one process in the losses, 4.2e-16 in the weights;
    # left out to keep the test's time down.)
    over = _rl_run(tmp_path) | {
        "rl.reward": "tests.rl_rewards:length",
        "rl.reward_workers": 1,
        "rl.group_size": 4,
        "rl.loss": "dapo",  # a token-level mean: a loss value that is not 0 at ratio 1
        "rl.beta": 0.05,  # the frozen reference, a whole MoE model of its own, is exercised too
    }
    one = tmp_path / "one"
    cfg, _ = start("rl", pretrained_moe, one, overrides=over)
    single = train(cfg, one, resume=True, progress_bar=False)
    want = _records(one)
    assert sorted(want) == [1, 2, 3] and want[3]["rl/kl"] > 0 and want[1]["moe/aux_loss"] > 0
    a = load_checkpoint(latest_checkpoint(one))["model"]
    run = tmp_path / "ep"
    start("rl", pretrained_moe, run, overrides={**over, "parallel.dp_shard": 2, "parallel.ep": 2})
    done = torchrun(2, ["-m", "lmforge", "rl", "--resume", "--run-dir", str(run)])
    assert done.returncode == 0, done.stderr[-4000:]
    got = _records(run)
    assert sorted(got) == [1, 2, 3]
    loads = [k for k in want[1] if k.endswith("/load")]
    assert len(loads) == 2
    # float64 throughout but the router's logits (FP32, from float64 hidden states that agree to ~1e-16, so
    # the same FP32 values and the same routing); an expert multiplies the rows of both ranks in one
    # product here, of one micro-batch there (a relative 2^-53 ~ 1e-16 per operation), which 3 Adam steps
    # carry into the next rollouts' losses at about that size (measured: below 1e-15). 1e-9 is that
    # with ample room and 60x below one FP32 rounding (6e-8): an FP32 step, an expert gradient left
    # unreduced over its ranks, a balance loss weighted otherwise or one other sampled token exceeds it.
    for step in want:
        for key in ("loss", "rl/reward_mean", "rl/kl", "rl/entropy", "rl/response_length", "moe/imbalance"):
            # rel=1e-9: the derivation above; abs=1e-12: a floor for records near 0, as in the first test
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-9, abs=1e-12), (step, key)
        for key in loads:  # tokens routed to each expert, summed over the ranks: counts, exactly equal
            assert got[step][key] == want[step][key], (step, key)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"] == "2 processes: dp_shard=2, ep=2 (FSDP2, ZeRO-3)"
    # rel=1e-9: as the records above (a float64 reward of greedy completions)
    assert summary["val_reward"] == pytest.approx(single["val_reward"], rel=1e-9)  # greedy, gathered copy
    b = load_checkpoint(latest_checkpoint(run))["model"]
    assert a.keys() == b.keys() and b["blocks.0.mlp.experts.gate_proj"].shape[0] == 4
    # the weights: Adam grows small gradients' rounding differences (measured 2.5e-16); 1e-11 is 20x below
    # what one FP32 rounding of a gradient moves a weight (lr 3e-3 x 6e-8)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-11
