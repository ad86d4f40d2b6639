"""``lmforge rl`` end to end on a tiny pretrained run: the KL to the reference is 0 at the first step, a
reward that raises or hangs is counted and the run goes on, resume equals the uninterrupted run, bad
input is one line and exit status 2 before anything is written; the reward sandbox on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.posttrain.finetune import start
from lmforge.posttrain.reward_pool import RewardPool
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def pretrained(corpus_dir, tmp_path_factory) -> Path:
    """A tiny pretrained run (20 steps of the tiny recipe)."""
    from lmforge.recipe import load_config

    root = tmp_path_factory.mktemp("pre")
    over = {**tiny_overrides(corpus_dir, root / "data"), "train.sample_tokens": 0, "data.seq_len": 64}
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


def _prompts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def _overrides(tmp_path: Path, reward: str = "tests.rl_rewards:length", **more) -> dict:
    texts = [f"def f{i}(x):" for i in range(8)]
    return {
        "posttrain.train_files": [_prompts(tmp_path / "prompts.jsonl", texts)],
        "posttrain.val_files": [_prompts(tmp_path / "val.jsonl", ["class A:", "import os"])],
        "rl.reward": reward,
        "rl.group_size": 4,
        "rl.max_new_tokens": 6,
        "rl.reward_timeout": 1.0,
        "train.steps": 4,
        "train.micro_batch_size": 2,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 2,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "optim.lr": 3e-3,
        "schedule.warmup": 1,
        **more,
    }


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_rl_trains_with_kl_zero_at_step_one_and_resumes_exactly(pretrained, tmp_path):
    """GRPO in cycles of 3 epochs over one step's rollouts (``rl.ppo_epochs = 3``, DeepSeekMath's mu): the
    rollouts are drawn at steps 1 and 4; the clip does not bind at step 1 (ratio 1) and binds at step 2
    (the same rollouts, the policy moved); a resume from step 2, inside a cycle, equals the uninterrupted
    run bitwise (its kept rollouts come from the checkpoint)."""
    over = _overrides(tmp_path, **{"rl.ppo_epochs": 3, "rl.clip_epsilon": 0.01})
    cfg, _ = start("rl", pretrained, tmp_path / "a", overrides=over)
    assert (tmp_path / "a" / "reference_model.pt").is_file()
    summary = train(cfg, tmp_path / "a", resume=True, progress_bar=False)
    steps = [r for r in _records(tmp_path / "a") if "rl/kl" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["rl/kl"] == 0.0  # policy = reference before the first update
    assert steps[-1]["rl/kl"] > 0.0  # and it moves away after
    assert [("rl/reward_mean" in r) for r in steps] == [True, False, False, True]  # drawn at 1 and 4
    for key in ("rl/reward_mean", "rl/reward_std", "rl/clip_fraction", "rl/entropy", "rl/response_length"):
        assert key in steps[-1], key
    assert steps[0]["rl/clip_fraction"] == 0.0 and steps[0]["rl/entropy"] > 0
    assert steps[1]["rl/clip_fraction"] > 0.0  # the second update of the same rollouts
    assert 1 <= steps[0]["rl/response_length"] <= 6 and steps[0]["rl/failed_rewards"] == 0
    assert "val_reward" in summary and summary["val_loss"] == -summary["val_reward"]

    cfg_b, _ = start("rl", pretrained, tmp_path / "b", overrides=over)
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False, callbacks=[StopAfter(2)])
    assert (latest_checkpoint(tmp_path / "b") / "rollouts").is_dir()  # stopped inside the cycle
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False)
    a = load_checkpoint(latest_checkpoint(tmp_path / "a"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "b"))["model"]
    # bitwise: an FP32 resume replays the same ops in the same order (measured max |diff| 0, 2-core Xeon with
    # AMX, default and AVX2-forced kernels, 1 and 2 threads); the rewards match exactly below
    assert all(torch.equal(a[k], b[k]) for k in a)
    after = [r for r in _records(tmp_path / "b") if "rl/kl" in r]
    assert [r.get("rl/reward_mean") for r in after] == [r.get("rl/reward_mean") for r in steps]
    assert [r["rl/clip_fraction"] for r in after] == [r["rl/clip_fraction"] for r in steps]


def test_a_reward_that_raises_or_hangs_is_counted_and_the_run_goes_on(pretrained, tmp_path):
    over = _overrides(tmp_path, "tests.rl_rewards:flaky", **{"train.steps": 2, "rl.reward_timeout": 0.5})
    texts = ["boom 1", "hang 2", "fine 3", "fine 4"]
    over["posttrain.train_files"] = [_prompts(tmp_path / "flaky.jsonl", texts)]
    over["rl.failed_reward"] = -1.0
    cfg, _ = start("rl", pretrained, tmp_path / "f", overrides=over)
    train(cfg, tmp_path / "f", resume=True, progress_bar=False)
    steps = [r for r in _records(tmp_path / "f") if "rl/kl" in r]
    assert len(steps) == 2  # the run finished
    # two steps of 2 prompts x 4 completions = 16 calls; the boom and hang prompts fail, 4 calls each
    assert sum(r["rl/failed_rewards"] for r in steps) == 8
    assert latest_checkpoint(tmp_path / "f").name == "step_00000002"


def test_reward_pool_scores_counts_failures_and_recovers():
    pool = RewardPool("tests.rl_rewards:flaky", timeout=0.5, workers=2, failed_value=-1.0)
    try:
        out = pool.score(["a", "boom", "hang", "b"], ["xy", "x", "x", "xyz"])
        assert out.rewards == [2 / 3, -1.0, -1.0, 1.0] and out.failed == 2
        assert "ValueError: boom" in out.first_error
        again = pool.score(["c"], ["x"])  # the pool still answers after a timeout
        assert again.rewards == [1 / 3] and again.failed == 0
    finally:
        pool.close()


def _exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as out:
        main(argv)
    return out.value.code or 0


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--rl.reward=tests.rl_rewards:no_such_function", "rl.reward"),
        ("--rl.reward=no_such_module_here:f", "rl.reward"),
        ("--rl.group_size=1", "rl.group_size"),
    ],
)
def test_bad_rl_input_is_one_line_exit_2_before_any_write(
    pretrained, tmp_path, capsys, cli_logging, flag, named
):
    prompts = _prompts(tmp_path / "p.jsonl", ["def f(x):"])
    argv = ["rl", "--from", str(pretrained), "--run-dir", str(tmp_path / "r")]
    assert _exit([*argv, f'--posttrain.train_files=["{prompts}"]', flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (tmp_path / "r").exists()


def test_ppo_trains_resumes_exactly_with_its_value_head_and_exports_without_it(pretrained, tmp_path):
    from safetensors import safe_open

    from lmforge.hf.export import export_run

    # 2 epochs over 2 mini-batches: one cycle of 4 steps, drawn at step 1; the resume at step 2 is inside it
    ppo = {"rl.algorithm": "ppo", "rl.group_size": 2, "rl.ppo_epochs": 2, "rl.mini_batches": 2}
    over = _overrides(tmp_path, **ppo, **{"rl.clip_epsilon": 0.01})
    cfg, step0 = start("rl", pretrained, tmp_path / "a", overrides=over)
    start_head = load_checkpoint(step0)["model"]["value_head.weight"]
    train(cfg, tmp_path / "a", resume=True, progress_bar=False)
    steps = [r for r in _records(tmp_path / "a") if "rl/kl" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["rl/kl"] == 0.0 and steps[-1]["rl/kl"] > 0.0  # policy = reference before the first update
    for key in ("rl/value_loss", "rl/explained_variance", "rl/clip_fraction", "rl/entropy"):
        assert key in steps[-1], key
    assert "rl/reward_std" in steps[0] and "rl/reward_std" not in steps[-1]  # the one cycle's draws
    assert steps[0]["rl/clip_fraction"] == 0.0 and steps[0]["rl/value_loss"] > 0.0
    assert all(r["rl/clip_fraction"] > 0.0 for r in steps[1:])  # rollouts drawn before the last update

    cfg_b, _ = start("rl", pretrained, tmp_path / "b", overrides=over)
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False, callbacks=[StopAfter(2)])
    assert (latest_checkpoint(tmp_path / "b") / "rollouts").is_dir()  # stopped inside the cycle
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False)
    a = load_checkpoint(latest_checkpoint(tmp_path / "a"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "b"))["model"]
    assert not torch.equal(a["value_head.weight"], start_head)  # the value head trains
    # bitwise, as in the test above (measured 0 on the same CPU, kernel paths and thread counts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    after = [r for r in _records(tmp_path / "b") if "rl/kl" in r]
    assert [r["rl/value_loss"] for r in after] == [r["rl/value_loss"] for r in steps]

    out = export_run(tmp_path / "a", tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        exported = set(f.keys())
    lm = export_run(pretrained, tmp_path / "hf-base")  # a plain language model's names
    with safe_open(str(lm / "model.safetensors"), "pt") as f:
        assert exported == set(f.keys())


def test_ppo_with_lora_trains_the_adapters_and_the_value_head(pretrained, tmp_path):
    """PPO under LoRA: the value head (new, randomly initialised) trains in full beside the adapters
    (``model/wrap.py::trained_heads``) and moves; every base weight stays bitwise equal."""
    over = _overrides(tmp_path, **{"train.steps": 2, "lora.rank": 4, "lora.targets": "all-linear"})
    over |= {"rl.algorithm": "ppo"}
    over.pop("posttrain.val_files")
    cfg, step0 = start("rl", pretrained, tmp_path / "r", overrides=over)
    train(cfg, tmp_path / "r", resume=True, progress_bar=False)
    before = load_checkpoint(step0)["model"]
    after = load_checkpoint(latest_checkpoint(tmp_path / "r"))["model"]
    head = [k for k in after if k.startswith("value_head.")]
    assert head and all(not torch.equal(before[k], after[k]) for k in head)
    assert all(torch.equal(before[k], after[k]) for k in after if ".lora_" not in k and k not in head)


def test_lora_rl_run_trains_the_adapters_against_the_base_as_reference(pretrained, tmp_path):
    over = _overrides(tmp_path, **{"train.steps": 2, "lora.rank": 4, "lora.targets": "all-linear"})
    over.pop("posttrain.val_files")
    cfg, step0 = start("rl", pretrained, tmp_path / "lora", overrides=over)
    train(cfg, tmp_path / "lora", resume=True, progress_bar=False)
    steps = [r for r in _records(tmp_path / "lora") if "rl/kl" in r]
    assert steps[0]["rl/kl"] == 0.0 and steps[1]["rl/kl"] > 0.0  # the reference is the start: base, B = 0
    before = load_checkpoint(step0)["model"]
    after = load_checkpoint(latest_checkpoint(tmp_path / "lora"))["model"]
    adapters = [k for k in after if k.endswith(".lora_B")]
    assert adapters and all(torch.equal(before[k], after[k]) for k in after if ".lora_" not in k)
    assert any(not torch.equal(before[k], after[k]) for k in adapters)
