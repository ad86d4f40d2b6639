"""``lmforge reward``: the Bradley-Terry loss by hand, the pooled token against transformers' rule, held-out
pairwise accuracy on a task with a known preference (a real standard-library docstring over a copy with
corrupted letters), exact resume, the Hugging Face sequence-classification export scored by
``transformers``, ``score()`` for RL code, and bad input refused in one line."""

from __future__ import annotations

import importlib
import inspect
import json
import math
import random
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.errors import UserError
from lmforge.evaluate.reward import load_reward_model, score, score_chats
from lmforge.hf.export import write_folder
from lmforge.posttrain.finetune import start
from lmforge.posttrain.records import read_pairs
from lmforge.posttrain.reward import RewardModel, bradley_terry_loss, last_token_index
from lmforge.recipe import load_config
from lmforge.tokenizer import Tokenizer
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

TRAIN_MODULES = ["os.path", "string", "json", "textwrap", "bisect", "heapq", "random", "statistics", "shutil"]
HELD_OUT_MODULES = ["functools", "glob", "fnmatch", "base64", "calendar", "copy", "difflib", "gzip"]


def docstring_lines(modules: list[str]) -> list[tuple[str, str]]:
    """``(qualified name, first docstring line)`` of the public functions and classes of ``modules`` whose
    first line has 20 to 60 characters."""
    out = []
    for m in modules:
        mod = importlib.import_module(m)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not callable(obj) or getattr(obj, "__module__", None) != mod.__name__:
                continue
            line = (inspect.getdoc(obj) or "").strip().splitlines()[:1]
            if line and 20 <= len(line[0]) <= 60:
                out.append((f"{m}.{name}", line[0]))
    return out


def corrupt(text: str, rng: random.Random) -> str:
    """``text`` with about a third of its letters replaced by random ones."""
    return "".join(
        rng.choice("abcdefghijklmnopqrstuvwxyz") if c.isalpha() and rng.random() < 0.35 else c for c in text
    )


def write_pairs(path: Path, modules: list[str], seed: int) -> Path:
    """Preference pairs with a known answer: the real docstring chosen, a corrupted copy rejected."""
    rng = random.Random(seed)
    lines = [
        json.dumps({"prompt": f"Describe {name}.", "chosen": doc, "rejected": corrupt(doc, rng)})
        for name, doc in docstring_lines(modules)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def base(corpus_dir, tmp_path_factory) -> Path:
    """A tiny pretrained run (20 steps of the tiny recipe, 96-token context)."""
    root = tmp_path_factory.mktemp("base")
    over = {**tiny_overrides(corpus_dir, root / "data"), "train.sample_tokens": 0, "data.seq_len": 96}
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


def reward_overrides(root: Path, steps: int, **more) -> dict:
    return {
        "posttrain.train_files": [str(write_pairs(root / "train.jsonl", TRAIN_MODULES, 0))],
        "posttrain.val_files": [str(write_pairs(root / "val.jsonl", HELD_OUT_MODULES, 1))],
        "train.steps": steps,
        "train.micro_batch_size": 8,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": steps,
        "train.checkpoint_interval": steps,
        "train.log_interval": 5,
        "optim.lr": 1e-3,
        **more,
    }


@pytest.fixture(scope="module")
def reward_run(base, tmp_path_factory) -> tuple[Path, dict]:
    """A reward model trained 20 steps (160 pairs drawn, about 2 epochs of the training pairs)."""
    root = tmp_path_factory.mktemp("reward")
    cfg, _ = start("reward", base, root / "run", overrides=reward_overrides(root, 20))
    return root / "run", train(cfg, root / "run", resume=True, progress_bar=False)


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    margin = torch.tensor([0.5, 0.0, 0.0])
    want = [math.log(1 + math.exp(-0.5)), math.log(2.0), math.log(1 + math.exp(2.0))]
    got = bradley_terry_loss(chosen, rejected, margin).tolist()
    # FP32 softplus against float64 math: ~1e-7 relative; rel 1e-6 (~17 u), and approx's default below
    assert got == pytest.approx(want, rel=1e-6)
    assert bradley_terry_loss(chosen, rejected, 1.5)[0].item() == pytest.approx(math.log(1 + math.exp(0.5)))


def test_pooled_token_is_the_rightmost_non_pad_as_transformers_pools():
    pad = 0
    inputs = torch.tensor([[0, 5, 6, 7, 0, 0], [0, 5, 0, 9, 8, 4], [0, 0, 0, 0, 0, 0], [3, 4, 0, 0, 0, 0]])
    assert last_token_index(inputs, pad).tolist() == [3, 5, 0, 1]


def test_margin_field_is_read_and_a_bad_one_reported(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "b", "margin": 2},
        {"prompt": "q", "chosen": "a", "rejected": "b"},
        {"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pairs, bad = read_pairs([path])
    assert [p.margin for p in pairs] == [2.0, None]
    assert len(bad) == 1 and bad[0].source.endswith(":3") and "margin" in bad[0].reason


def test_heldout_pairwise_accuracy_above_0_9(reward_run):
    run, summary = reward_run
    seen = {json.loads(x)["prompt"] for x in (run.parent / "train.jsonl").read_text().splitlines()}
    held = {json.loads(x)["prompt"] for x in (run.parent / "val.jsonl").read_text().splitlines()}
    assert held and not seen & held  # held-out pairs were never trained on
    print("held-out accuracy", summary["val_rewards/accuracies"], "margin", summary["val_rewards/margins"])
    # docs/post-training.md: measured 1.000 (37 of 37 held-out pairs, 2-core Xeon with AMX); > 0.9 lets 3 fail
    assert summary["val_rewards/accuracies"] > 0.9
    assert summary["val_rewards/margins"] > 0
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in steps if "loss" in x][-1]
    assert {"rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected"} <= set(last)


def test_resume_equals_the_uninterrupted_run(base, tmp_path):
    over = reward_overrides(tmp_path, 8, **{"train.checkpoint_interval": 4, "train.eval_interval": 4})
    cfg, _ = start("reward", base, tmp_path / "a", overrides=over)
    straight = train(cfg, tmp_path / "a", resume=True, progress_bar=False)
    cfg_b, _ = start("reward", base, tmp_path / "b", overrides=over)
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False, callbacks=[StopAfter(4)])
    resumed = train(cfg_b, tmp_path / "b", resume=True, progress_bar=False)
    a = load_checkpoint(latest_checkpoint(tmp_path / "a"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "b"))["model"]
    assert "score.weight" in a and "lm_head.weight" not in a
    # bitwise: an FP32 resume replays the same ops in the same order, as in test_optimizers.py (measured max
    # |diff| 0 for weights and val_loss, 2-core Xeon with AMX, default and AVX2-forced kernels, 1 and 2 threads)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == straight["val_loss"]


def _hf_scores(folder: Path, rows: list[list[int]], pad: int) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (len(rows), 1)
    return logits[:, 0].tolist()


def test_export_loads_in_transformers_with_equal_scores(reward_run, tmp_path, cli_logging):
    from transformers import AutoTokenizer

    run, _ = reward_run
    with pytest.raises(SystemExit) as out:
        main(["export", str(run), "--out", str(tmp_path / "hf")])
    assert (out.value.code or 0) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    scorer = load_reward_model(run)
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    assert config["pad_token_id"] == scorer.tokenizer.eot_id
    texts = [x for x in (run.parent / "val.jsonl").read_text().splitlines()][:6]
    chats = [(json.loads(t)["prompt"], json.loads(t)[side]) for t in texts for side in ("chosen", "rejected")]
    ours = score_chats(scorer, chats)
    rows = [
        scorer.tokenizer.encode(f"<|endoftext|><|user|>\n{p}<|end|>\n<|assistant|>\n{r}<|end|>\n")
        for p, r in chats
    ]
    theirs = _hf_scores(tmp_path / "hf", rows, scorer.tokenizer.eot_id)
    # FP32 scores on the same weights in other kernels: test_hf_export.py's TOL for logits (measured 4.8e-7
    # there); a score is one more width-32 dot product of such a hidden state. Measured here (2-core Xeon with
    # AMX, default and AVX2-forced kernels, 1 and 2 threads): at most 1.8e-7
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
    # score(run, texts): the texts encoded as the exported tokenizer encodes them
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = f"<|endoftext|><|user|>\n{chats[0][0]}<|end|>\n<|assistant|>\n{chats[0][1]}<|end|>\n"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == scorer.tokenizer.encode(text)
    # the same bound: lmforge's own score of the text against transformers' (see above; measured <= 3e-8)
    assert score(run, [text])[0] == pytest.approx(theirs[0], abs=1e-4)


def test_gpt2_reward_model_exports_with_equal_scores(base, tmp_path):
    tok = Tokenizer(base / "tokenizer.json")
    cfg = ModelConfig(arch="gpt2", n_layers=2, d_model=32, n_heads=4)
    torch.manual_seed(0)
    model = RewardModel(cfg, tok.vocab_size, 32)
    model.init_weights()
    write_folder(tmp_path / "hf", cfg, model.state_dict(), tok, 32)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "GPT2ForSequenceClassification"
    ]
    rows = [tok.encode("def f(x):\n    return x"), tok.encode("class A:\n    pass\n# end")]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [tok.eot_id] * (width - len(r)) for r in rows])
    with torch.no_grad():
        ours = model.rewards(ids, tok.eot_id).tolist()
    theirs = _hf_scores(tmp_path / "hf", rows, tok.eot_id)
    # FP32, the same weights: as test_hf_export.py's TOL (GPT-2 logits measured 0 there); rounding room
    # (measured at most 7.5e-9 on the CPU above)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4


def _exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as out:
        main(argv)
    return out.value.code or 0


def test_bad_input_is_one_line_exit_2_with_nothing_written(base, tmp_path, capsys, cli_logging):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}) + "\n")
    files = f'--posttrain.train_files=["{bad}"]'
    assert _exit(["reward", "--from", str(base), "--run-dir", str(tmp_path / "x"), files]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "posttrain.train_files" in err[0] and "margin" in err[0]
    good = f'--posttrain.train_files=["{write_pairs(tmp_path / "ok.jsonl", ["bisect"], 0)}"]'
    argv = ["reward", "--from", str(base), "--run-dir", str(tmp_path / "y"), good, "--train.sample_tokens=5"]
    assert _exit(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.sample_tokens" in err[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    with pytest.raises(UserError, match="not a reward model"):
        score(base, ["text"])
