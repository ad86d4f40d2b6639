"""``rl.reward = "run:PATH"``: a reward model trained in the test scores a short RL run's completions,
each sample's reward equal to ``evaluate/reward.py::score`` of its text computed on its own; a folder that
is no reward run and a reward run with another tokenizer refused in one line, exit status 2, before
anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.evaluate.reward import score
from lmforge.posttrain.finetune import start
from lmforge.posttrain.reward_model_reward import tokenizer_difference
from lmforge.posttrain.template import add_chat_tokens
from lmforge.tokenizer import train_tokenizer
from lmforge.train.callbacks import Callback
from lmforge.train.launch import train
from tests.test_reward import base, reward_overrides  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def reward_run(base, tmp_path_factory) -> Path:  # noqa: F811
    """A reward model trained 6 steps of 8 pairs from the tests' tiny base run."""
    root = tmp_path_factory.mktemp("rm")
    cfg, _ = start("reward", base, root / "run", overrides=reward_overrides(root, 6))
    train(cfg, root / "run", resume=True, progress_bar=False)
    return root / "run"


def _prompts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return str(path)


def _rl_overrides(tmp_path: Path, reward: str) -> dict:
    return {
        "posttrain.train_files": [
            _prompts(tmp_path / "prompts.jsonl", [f"Describe f{i}." for i in range(6)])
        ],
        "rl.reward": reward,
        "rl.group_size": 4,
        "rl.max_new_tokens": 8,
        "train.steps": 2,
        "train.micro_batch_size": 2,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 2,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "optim.lr": 3e-3,
        "schedule.warmup": 1,
    }


class RecordRewards(Callback):
    """Keeps every ``(prompts, completions, rewards)`` the RL objective's reward returned in the run."""

    def __init__(self):
        self.calls: list[tuple[list[str], list[str], list[float]]] = []

    def on_train_start(self, trainer) -> None:
        objective, calls = trainer.run.module.objective, self.calls
        inner = objective.reward

        class Recorded:
            def score(self, prompts, completions):
                out = inner.score(prompts, completions)
                calls.append((list(prompts), list(completions), list(out.rewards)))
                return out

            def close(self):
                inner.close()

        objective.reward = Recorded()


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_reward_model_scores_rl_samples_as_score_does(base, reward_run, tmp_path):  # noqa: F811
    cfg, _ = start("rl", base, tmp_path / "rl", overrides=_rl_overrides(tmp_path, f"run:{reward_run}"))
    recorder = RecordRewards()
    train(cfg, tmp_path / "rl", resume=True, progress_bar=False, callbacks=[recorder])
    assert len(recorder.calls) == 2  # one micro-batch a step, 2 prompts x 4 completions each
    steps = [r for r in _records(tmp_path / "rl") if "rl/reward_mean" in r]
    for (prompts, completions, rewards), record in zip(recorder.calls, steps, strict=True):
        assert len(rewards) == 8 and record["rl/failed_rewards"] == 0
        # the sample's text as the reward model's training pairs read: the chat template, written out here
        texts = [
            f"<|endoftext|><|user|>\n{p}<|end|>\n<|assistant|>\n{c}<|end|>\n"
            for p, c in zip(prompts, completions, strict=True)
        ]
        want = score(reward_run, texts)  # loaded by lmforge eval's loader, on its own
        # the same FP32 model and ids in batches of the same rows: equal up to summation order, ~1e-7 of
        # rewards of order 1; 1e-5 leaves room and would still catch another token or position read
        assert rewards == pytest.approx(want, abs=1e-5)
        # the mean of 8 such rewards: the same abs=1e-5
        assert record["rl/reward_mean"] == pytest.approx(sum(want) / len(want), abs=1e-5)
    every = [r for _, _, rewards in recorder.calls for r in rewards]
    assert max(every) - min(every) > 1e-3  # the reward tells completions apart: the check above can fail


def _exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as out:
        main(argv)
    return out.value.code or 0


@pytest.fixture
def other_tokenizer_run(reward_run, corpus_dir, tmp_path) -> Path:
    """The reward run with the tokenizer of another base (a BPE of 300 entries, the chat tokens added)."""
    run = tmp_path / "other_rm"
    shutil.copytree(reward_run, run)
    texts = [json.loads(x)["text"] for x in (corpus_dir / "stdlib.jsonl").read_text().splitlines()]
    train_tokenizer(texts, 300, tmp_path / "plain.json")
    add_chat_tokens(tmp_path / "plain.json", run / "tokenizer.json")
    return run


@pytest.mark.parametrize(
    ("which", "named"),
    [
        ("base", "not a reward model"),
        ("missing", "not an lmforge run folder"),
        ("other_tokenizer", "vocabulary has 304 tokens"),
    ],
)
def test_bad_reward_run_is_one_line_exit_2_before_any_write(
    base,  # noqa: F811
    other_tokenizer_run,
    tmp_path,
    capsys,
    cli_logging,
    which,
    named,
):
    path = {"base": base, "missing": tmp_path / "nowhere", "other_tokenizer": other_tokenizer_run}[which]
    prompts = _prompts(tmp_path / "p.jsonl", ["Describe f."])
    argv = [
        "rl",
        "--from",
        str(base),
        "--run-dir",
        str(tmp_path / "r"),
        f'--posttrain.train_files=["{prompts}"]',
    ]
    assert _exit([*argv, f"--rl.reward=run:{path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rl.reward" in err[0] and named in err[0], err
    if which == "other_tokenizer":
        assert "lmforge reward --from" in err[0]  # the fix
    assert not (tmp_path / "r").exists()


def test_tokenizer_difference_names_what_differs(reward_run, tmp_path):
    ours = reward_run / "tokenizer.json"
    assert tokenizer_difference(ours, ours) is None
    doc = json.loads(ours.read_text())
    vocab = doc["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two merged tokens' ids exchanged
    swapped = {**doc, "model": {**doc["model"], "vocab": {**vocab, a: vocab[b], b: vocab[a]}}}
    (tmp_path / "swapped.json").write_text(json.dumps(swapped))
    assert tokenizer_difference(ours, tmp_path / "swapped.json") == (
        f"token id {vocab[a]} is {b!r} there, {a!r} in the policy's"
    )
    lower = {**doc, "normalizer": {"type": "Lowercase"}}
    (tmp_path / "lower.json").write_text(json.dumps(lower))
    assert tokenizer_difference(ours, tmp_path / "lower.json") == "the same vocabulary but another normalizer"
    (tmp_path / "spaced.json").write_text(json.dumps(doc, indent=1))  # the same tokenizer, written otherwise
    assert tokenizer_difference(ours, tmp_path / "spaced.json") is None
