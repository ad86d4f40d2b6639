"""``lmforge sft`` / ``lmforge dpo`` end to end on a tiny pretrained run: the run folder they start, the
grown vocabulary, exact resume, bad records reported, the DPO reference, eval and generate of a chat run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.cli import main
from lmforge.config import Config
from lmforge.posttrain.finetune import start
from lmforge.posttrain.records import Turn
from lmforge.posttrain.template import SPECIAL_TOKENS, read_template
from lmforge.recipe import load_saved_config
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import cli_args, tiny_overrides

FUNCS = ["read", "write", "open", "close", "seek", "tell", "flush", "parse", "join", "split", "copy", "sort"]
TRAIN_FUNCS, HELD_OUT_FUNCS = FUNCS[:9], FUNCS[9:]  # held-out records ask about names training never saw


def _records(path: Path, n: int, names: list[str] = TRAIN_FUNCS, bad: bool = False) -> Path:
    lines = []
    for i in range(n):
        name = names[i % len(names)]
        lines.append(
            json.dumps(
                {"instruction": f"What does `{name}` do?", "input": "", "output": f"It will {name} it."}
            )
        )
    if bad:
        lines.insert(1, json.dumps({"instruction": "no output here"}))
        lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path


def _pairs(path: Path, n: int, names: list[str] = TRAIN_FUNCS) -> Path:
    lines = []
    for i in range(n):
        name, other = names[i % len(names)], names[(i + 1 + len(names) // 2) % len(names)]
        lines.append(
            json.dumps(
                {
                    "prompt": f"What does `{name}` do?",
                    "chosen": f"It will {name} it.",
                    "rejected": f"It will {other} it.",
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _held_out(train_file: Path, val_file: Path) -> Path:
    """``val_file``, checked to share no question with ``train_file``: held-out records are unseen."""

    def questions(path: Path) -> set[str]:
        records = [json.loads(x) for x in path.read_text().splitlines() if x.startswith('{"')]
        return {r.get("instruction", r.get("prompt")) for r in records}

    seen, held = questions(train_file), questions(val_file)
    assert held and not held & seen
    return val_file


@pytest.fixture(scope="module")
def pretrained(corpus_dir, tmp_path_factory) -> Path:
    """A tiny pretrained run (20 steps of the tiny recipe)."""
    root = tmp_path_factory.mktemp("pre")
    from lmforge.recipe import load_config

    cfg = load_config(
        None, {**tiny_overrides(corpus_dir, root / "data"), "train.sample_tokens": 0, "data.seq_len": 64}
    )
    train(cfg, root / "run", progress_bar=False)
    return root / "run"


def _sft_overrides(tmp_path: Path, steps: int = 12, **more) -> dict:
    return {
        "posttrain.train_files": [str(_records(tmp_path / "train.jsonl", 24, bad=True))],
        "posttrain.val_files": [
            str(_held_out(tmp_path / "train.jsonl", _records(tmp_path / "val.jsonl", 6, HELD_OUT_FUNCS)))
        ],
        "train.steps": steps,
        "train.micro_batch_size": 4,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 6,
        "train.checkpoint_interval": 6,
        "train.log_interval": 2,
        "train.sample_tokens": 6,
        "schedule.warmup": 2,
        "metrics.detail_interval": 4,  # the detail records' measuring forward runs on SFT and DPO batches
        **more,
    }


def test_sft_starts_from_the_run_with_the_chat_tokens_and_mean_rows(pretrained, tmp_path):
    cfg, ckpt = start("sft", pretrained, tmp_path / "sft", overrides=_sft_overrides(tmp_path))
    assert ckpt == latest_checkpoint(tmp_path / "sft") and ckpt.name == "step_00000000"
    before = load_checkpoint(latest_checkpoint(pretrained))["model"]
    after = load_checkpoint(ckpt)["model"]
    old = before["embed.weight"].shape[0]
    assert after["embed.weight"].shape[0] == old + len(SPECIAL_TOKENS) == cfg.data.vocab_size
    assert torch.equal(after["embed.weight"][:old], before["embed.weight"])
    # the new rows are an FP32 mean of the old ones (allclose's default: 1e-5 relative); measured equal
    assert torch.allclose(
        after["embed.weight"][old:], before["embed.weight"].mean(0).expand(len(SPECIAL_TOKENS), -1)
    )
    for k in before:
        if k not in ("embed.weight", "lm_head.weight"):
            assert torch.equal(before[k], after[k]), k
    assert read_template(tmp_path / "sft") is not None
    source = load_saved_config(pretrained / "config.toml")
    assert cfg.model == source.model and cfg.data.seq_len == source.data.seq_len
    saved = load_saved_config(tmp_path / "sft" / "config.toml")
    assert saved.data.sources == source.data.sources != Config().data.sources  # the base run's, recorded
    assert cfg.train.objective == "sft" and cfg.train.steps == 12  # the flag over sft's own default (300)
    bad = [json.loads(x) for x in (tmp_path / "sft" / "bad_records.jsonl").read_text().splitlines()]
    assert [b["source"].rsplit(":", 1)[1] for b in bad] == ["2", "4"]  # file:line of each bad record


def test_sft_trains_lowers_heldout_loss_and_resumes_exactly(pretrained, tmp_path):
    over = _sft_overrides(tmp_path)
    cfg, _ = start("sft", pretrained, tmp_path / "a", overrides=over)
    straight = train(cfg, tmp_path / "a", resume=True, progress_bar=False)
    cfg_b, _ = start("sft", pretrained, tmp_path / "b", overrides=over)
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False, callbacks=[StopAfter(6)])
    resumed = train(cfg_b, tmp_path / "b", resume=True, progress_bar=False)
    a = load_checkpoint(latest_checkpoint(tmp_path / "a"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "b"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == straight["val_loss"]
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    evals = [x["val_loss"] for x in lines if "val_loss" in x]
    first = evals[0]
    assert straight["val_loss"] < first  # response loss on held-out records falls
    assert "-->" in straight["sample"]


def test_dpo_cached_reference_and_trl_metrics(pretrained, tmp_path):
    sft_over = _sft_overrides(tmp_path, steps=6)
    cfg, _ = start("sft", pretrained, tmp_path / "sft", overrides=sft_over)
    train(cfg, tmp_path / "sft", resume=True, progress_bar=False)
    over = {
        **{k: v for k, v in sft_over.items() if not k.startswith("posttrain.")},
        "posttrain.train_files": [str(_pairs(tmp_path / "p.jsonl", 16))],
        "posttrain.val_files": [
            str(_held_out(tmp_path / "p.jsonl", _pairs(tmp_path / "pv.jsonl", 4, HELD_OUT_FUNCS)))
        ],
        "train.steps": 8,
        "optim.lr": 1e-3,
    }
    cfg, _ = start("dpo", tmp_path / "sft", tmp_path / "dpo", overrides=over)
    cached = np.load(tmp_path / "dpo" / "reference_logps.npz")
    assert cached["train"].shape == (16, 2) and cached["val"].shape == (4, 2)
    summary = train(cfg, tmp_path / "dpo", resume=True, progress_bar=False)
    lines = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    step_lines = [x for x in lines if "loss" in x]
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
    ):
        assert name in step_lines[-1], name
    assert "val_rewards/accuracies" in summary and 0.0 <= summary["val_rewards/accuracies"] <= 1.0


def _exit(argv: list[str]) -> int:
    """The CLI's exit status for ``argv``."""
    with pytest.raises(SystemExit) as out:
        main(argv)
    return out.value.code or 0


def test_cli_refuses_model_flags_and_missing_from(pretrained, tmp_path, capsys, cli_logging):
    assert _exit(["sft", "--run-dir", str(tmp_path / "x")]) == 2
    assert "--from" in capsys.readouterr().err
    assert (
        _exit(["sft", "--from", str(pretrained), "--run-dir", str(tmp_path / "y"), "--model.n_layers=4"]) == 2
    )
    assert "--model.n_layers" in capsys.readouterr().err
    assert _exit(["dpo", "--from", str(tmp_path / "nothing"), "--run-dir", str(tmp_path / "z")]) == 2
    assert "--from" in capsys.readouterr().err
    missing = '--posttrain.train_files=["' + str(tmp_path / "none.jsonl") + '"]'
    assert _exit(["sft", "--from", str(pretrained), "--run-dir", str(tmp_path / "w"), missing]) == 2
    assert "posttrain.train_files" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "yzw")  # nothing written
    inside = pretrained / "sft"
    assert (
        _exit(
            ["sft", "--from", str(pretrained), "--run-dir", str(inside), *cli_args(_sft_overrides(tmp_path))]
        )
        == 2
    )
    assert f"{inside} lies inside the run folder {pretrained.resolve()}" in capsys.readouterr().err
    assert not inside.exists()


def test_cli_names_the_checkpoint_it_started_from(pretrained, tmp_path, capsys, cli_logging):
    run = tmp_path / "s"
    argv = ["sft", "--from", str(pretrained), "--step", "10", "--run-dir", str(run), "--prepare-only"]
    assert _exit([*argv, *cli_args(_sft_overrides(tmp_path))]) == 0
    assert f"(started from {pretrained}: step_00000010)" in capsys.readouterr().out


def test_cli_sft_then_eval_generate_and_export_use_the_template(pretrained, tmp_path, capsys, cli_logging):
    over = _sft_overrides(tmp_path, steps=4)
    run = tmp_path / "s"
    assert _exit(["sft", "--from", str(pretrained), "--run-dir", str(run), *cli_args(over)]) == 0
    out = capsys.readouterr().out
    assert "done: step 4, held-out loss" in out
    # the pretrained run's newest checkpoint (20 steps, one every 10), not the new run's step 0
    assert f"run folder: {run} (started from {pretrained}: step_00000020)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert _exit(["eval", str(run)]) == 0
    scored = json.loads(capsys.readouterr().out)
    # eval scores as training did: measured equal; 1e-6 is 8 FP32 ulps of room
    assert scored["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert _exit(["generate", str(run), "--prompt", "What does `read` do?", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert _exit(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "What does `read` do?"}]
    want = read_template(run).prompt_ids([Turn("user", "What does `read` do?")])
    assert (
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        == want
    )


def test_dpo_frozen_reference_model(pretrained, tmp_path):
    """``dpo.reference = "model"``: the starting weights are kept and a frozen copy scores each batch; at the
    first step the policy is the reference, so the training pairs' rewards start at zero."""
    over = {
        **{k: v for k, v in _sft_overrides(tmp_path, steps=3).items() if not k.startswith("posttrain.")},
        "posttrain.train_files": [str(_pairs(tmp_path / "p.jsonl", 8))],
        "posttrain.val_files": [
            str(_held_out(tmp_path / "p.jsonl", _pairs(tmp_path / "pv.jsonl", 4, HELD_OUT_FUNCS)))
        ],
        "dpo.reference": "model",
        "train.log_interval": 1,
    }
    cfg, _ = start("dpo", pretrained, tmp_path / "dpo", overrides=over)
    assert (tmp_path / "dpo" / "reference_model.pt").is_file()
    assert not (tmp_path / "dpo" / "reference_logps.npz").exists()
    summary = train(cfg, tmp_path / "dpo", resume=True, progress_bar=False)
    first = next(json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
    # step 1 starts at the reference: margins 0 and the loss log 2 = 0.693147 (to the 6 digits written), up
    # to FP32 rounding of log-probabilities near 30 (ulp 1.9e-6) times beta: both bounds are that room
    assert (
        first["step"] == 1 and abs(first["rewards/margins"]) < 1e-5 and abs(first["loss"] - 0.693147) < 1e-4
    )
    assert "val_rewards/margins" in summary


def test_dpo_step_figures_count_the_positions_computed(pretrained, corpus_dir, tmp_path):
    """Pairs far shorter than ``data.seq_len`` (160) run as rows padded to 64 positions (the longest pair
    rounded up to a multiple of 64): ``batch_tokens``, ``tokens_per_s`` and ``mfu`` count those positions,
    not ``2 x pairs x seq_len``."""
    from lmforge.plan.flops import model_flops_per_token
    from lmforge.recipe import load_config

    base = load_config(
        None,
        {
            **tiny_overrides(corpus_dir, pretrained.parent / "data"),
            "data.seq_len": 160,
            "train.steps": 2,
            "train.sample_tokens": 0,
        },
    )
    train(base, tmp_path / "long", progress_bar=False)
    over = {
        **{k: v for k, v in _sft_overrides(tmp_path, steps=3).items() if not k.startswith("posttrain.")},
        "posttrain.train_files": [str(_pairs(tmp_path / "p.jsonl", 16))],
        "posttrain.val_files": [
            str(_held_out(tmp_path / "p.jsonl", _pairs(tmp_path / "pv.jsonl", 4, HELD_OUT_FUNCS)))
        ],
        "train.tokens_per_step": 2 * 4 * 160,  # 2 micro-batches of 4 pairs a step
        "train.log_interval": 1,
    }
    cfg, _ = start("dpo", tmp_path / "long", tmp_path / "dpo", overrides=over)
    template = read_template(tmp_path / "dpo")
    longest = max(
        len(template.render([Turn("user", f"What does `{f}` do?"), Turn("assistant", f"It will {f} it.")])[0])
        for f in FUNCS
    )
    assert longest - 1 <= 64 < cfg.data.seq_len  # every row's inputs fit 64 positions
    train(cfg, tmp_path / "dpo", resume=True, progress_bar=False)
    steps = [json.loads(x) for x in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in steps if "tokens_per_s" in x]
    assert [x["step"] for x in steps] == [1, 2, 3]
    per_token = model_flops_per_token(cfg.model, cfg.data.vocab_size, 64)  # attention over 64 positions
    for x in steps:
        assert x["batch_tokens"] == 2 * (2 * 4) * 64  # 2 micro-batches of 8 rows of 64 positions
        if "mfu" in x:
            want = x["tokens_per_s"] * per_token / (x["peak_tflops"] * 1e12)
            assert x["mfu"] == pytest.approx(want, rel=1e-4)  # the record's 6 significant digits
