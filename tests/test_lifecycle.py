"""The run lifecycle: resume from the run's own config, stops that lose nothing, honest console output,
warnings before training, and argument checks of ``generate``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from lmforge.cli import main
from lmforge.data.preflight import (
    check_epochs,
    check_sample_prompt,
    check_validation,
    check_vocab,
    default_sample_prompt,
    preflight,
)
from lmforge.data.prepare import prepare_data
from lmforge.errors import ConfigError, Interrupted, UserError
from lmforge.recipe import load_config
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.checkpointing import config_state
from lmforge.train.callbacks.control import StopOnSignal, any_rank
from lmforge.train.callbacks.metrics import eta_seconds
from lmforge.train.callbacks.sinks import format_duration
from lmforge.train.checkpoint import latest_checkpoint
from lmforge.train.launch import train
from lmforge.train.resume import Change, check_changes, config_changes, read_history, resume_config
from tests.conftest import cli_args, tiny_overrides

# Tolerances: each pytest.approx here compares float64 arithmetic on Python numbers (times, token counts) with
# the same formula written by hand: the CPU does not enter, and the bounds (the default 1e-6, or 1e-9) only
# absorb rounding in another order (~1e-16 relative).


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def _losses(run: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["loss"]) for x in lines if "loss" in x and "event" not in x]


# -- resume continues the run that was started ------------------------------------------------------


def test_resume_reads_the_runs_own_config(corpus_dir, tmp_path, capsys, caplog):
    """A finished 10-step run on a JSONL corpus, resumed with only --train.steps: it keeps its data, model
    and schedule (the defaults would load the built-in corpus), logs the change and records it."""
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {"train.steps": 10, "train.sample_tokens": 0}
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", "--run-dir", str(run), *cli_args(over))
    assert code == 0, err

    code, _, err = run_cli(capsys, "train", "--resume", "--run-dir", str(run))
    assert code == 2 and "already finished" in err and "--train.steps=N" in err
    assert err.count("\n") == 1  # one line

    with caplog.at_level(logging.INFO, logger="lmforge"):
        code, out, err = run_cli(capsys, "train", "--resume", "--run-dir", str(run), "--train.steps=20")
    assert code == 0, err
    assert "done: step 20" in out
    assert "resume at step 10: train.steps 10 -> 20" in caplog.text
    assert "learning rate goes from" in caplog.text  # the cosine now spans 20 steps
    saved = load_config(run / "config.toml")  # still a valid recipe, history and all
    assert saved.data.sources[0].path == over["data.sources"][0]["path"] and saved.train.steps == 20
    assert saved.model.d_model == 32
    assert read_history(run / "config.toml") == ["# step 10: train.steps 10 -> 20"]
    steps = [s for s, _ in _losses(run)]
    assert steps == [5, 10, 15, 20]


@pytest.mark.parametrize(
    ("flag", "key"),
    [
        ("--model.d_model=64", "model.d_model"),
        ("--data.vocab_size=300", "data.vocab_size"),
        ("--data.sources=[{path='builtin:pystdlib'}]", "data.sources"),
        ("--train.seed=1", "train.seed"),
        ("--optim.name=lion", "optim.name"),
        ("--train.steps=5", "train.steps"),
    ],
)
def test_resume_refuses_changes_that_cannot_continue(tiny_config, tmp_path, capsys, flag, key):
    from lmforge.train.callbacks.control import StopAfter

    run = tmp_path / "run"
    train(tiny_config, run, progress_bar=False, callbacks=[StopAfter(10)])
    before = (run / "config.toml").read_text()
    code, _, err = run_cli(capsys, "train", "--resume", "--run-dir", str(run), flag)
    assert code == 2 and err.startswith(f"lmforge train: error: {key}:") and err.count("\n") == 1, err
    assert (run / "config.toml").read_text() == before  # nothing written
    assert latest_checkpoint(run).name == "step_00000010"


def test_resume_allows_safe_changes_and_keeps_their_history(tiny_config, tmp_path, capsys):
    from lmforge.train.callbacks.control import StopAfter

    run = tmp_path / "run"
    train(tiny_config, run, progress_bar=False, callbacks=[StopAfter(10)])
    code, _, err = run_cli(
        capsys, "train", "--resume", "--run-dir", str(run), "--train.eval_interval=5", "--optim.lr=1e-3"
    )
    assert code == 0, err
    assert read_history(run / "config.toml") == [
        "# step 10: optim.lr 0.003 -> 0.001",
        "# step 10: train.eval_interval 10 -> 5",
    ]
    vals = [
        json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in x
    ]
    assert vals == [10, 15, 20]


def test_extending_a_wsd_run_before_its_decay_equals_planning_it_longer(tiny_config, tmp_path, capsys):
    """WSD's stable phase does not depend on the length of the run, so a 20-step WSD run stopped at step
    10 and extended to 30 steps (its decay moved from step 16 to 24) trains exactly as a 30-step run."""
    from lmforge.train.callbacks.control import StopAfter

    def wsd(steps: int):
        t = tiny_config.train.model_copy(update={"steps": steps, "eval_interval": 0, "log_interval": 1})
        return tiny_config.model_copy(
            update={"train": t, "schedule": tiny_config.schedule.model_copy(update={"name": "wsd"})}
        )

    train(wsd(30), tmp_path / "planned", progress_bar=False)
    run = tmp_path / "extended"
    train(wsd(20), run, progress_bar=False, callbacks=[StopAfter(10)])
    code, _, err = run_cli(capsys, "train", "--resume", "--run-dir", str(run), "--train.steps=30")
    assert code == 0, err
    assert _losses(run) == _losses(tmp_path / "planned")
    assert read_history(run / "config.toml") == ["# step 10: train.steps 20 -> 30"]


def test_check_changes_rules():
    check_changes([Change("train.eval_interval", 10, 5), Change("data.cache_dir", "a", "b")], 10, 20)
    with pytest.raises(ConfigError, match=r"^model\.n_layers: "):
        check_changes([Change("model.n_layers", 2, 3)], 10, 20)
    with pytest.raises(ConfigError, match=r"^train\.steps: 5 is below"):
        check_changes([], 10, 5)
    with pytest.raises(UserError, match="already finished"):
        check_changes([], 10, 10)


def test_resume_config_layers(tiny_config, tmp_path):
    from lmforge.recipe import to_toml

    (tmp_path / "config.toml").write_text(to_toml(tiny_config))
    recipe = tmp_path / "more.toml"
    recipe.write_text("[train]\nlog_interval = 2\n")
    cfg = resume_config(tmp_path, str(recipe), {"train.steps": 30})
    assert (cfg.train.log_interval, cfg.train.steps, cfg.data.vocab_size) == (2, 30, 512)
    assert [c.key for c in config_changes(config_state(tiny_config), cfg)] == [
        "train.log_interval",
        "train.steps",
    ]
    with pytest.raises(UserError, match=r"config\.toml is missing"):
        resume_config(tmp_path / "nowhere", None, {})


def test_new_run_refuses_a_folder_with_metrics_but_no_checkpoint(tiny_config, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 5, "loss": 4.0}\n')
    with pytest.raises(UserError, match="metrics of an earlier run"):
        train(tiny_config, run, progress_bar=False)
    assert (run / "metrics.jsonl").read_text() == '{"step": 5, "loss": 4.0}\n'
    assert not (run / "tensorboard").exists()


# -- stops that lose nothing -------------------------------------------------------------------------


class SignalAt(Callback):
    """Sends ``sig`` to this process at the end of step ``step`` (as a user or scheduler would)."""

    def __init__(self, step: int, sig: signal.Signals):
        self.step, self.sig = step, sig

    def on_step_end(self, trainer, result) -> None:
        if trainer.progress.step == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.fixture
def sigint_default():
    """SIGINT as an interactive process has it (a background job of a script starts with it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_default")
def test_sigint_finishes_the_step_checkpoints_and_resumes_exactly(tiny_config, tmp_path):
    straight = train(tiny_config, tmp_path / "straight", progress_bar=False)
    run = tmp_path / "run"
    stopped = train(tiny_config, run, progress_bar=False, callbacks=[SignalAt(6, signal.SIGINT)])
    # the signal arrives after step 6's StopOnSignal check: step 7 finishes, then the run stops
    assert stopped["stopped"] and stopped["reason"] == "SIGINT" and stopped["step"] == 7
    assert Path(stopped["checkpoint"]).name == "step_00000007" == latest_checkpoint(run).name
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    resumed = train(tiny_config, run, resume=True, progress_bar=False)
    assert resumed["val_loss"] == straight["val_loss"]
    assert _losses(run) == _losses(tmp_path / "straight")


def test_an_ignored_signal_stays_ignored(tiny_config, tmp_path):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        summary = train(
            tiny_config, tmp_path / "run", progress_bar=False, callbacks=[SignalAt(6, signal.SIGINT)]
        )
        assert not summary.get("stopped") and summary["step"] == 20
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_second_signal_exits_at_once():
    cb = StopOnSignal()
    cb._handle(signal.SIGTERM, None)
    assert cb.received is signal.SIGTERM
    with pytest.raises(Interrupted) as exc:
        cb._handle(signal.SIGTERM, None)
    assert exc.value.signal == signal.SIGTERM


def _agree(rank: int, world: int, init: str, flags: list[bool], out) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        out.put((rank, any_rank(flags[rank])))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("flags", [[True, False], [False, False]])
def test_every_rank_agrees_on_a_stop(tmp_path, flags):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_agree, args=(r, 2, init, flags, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == {0: any(flags), 1: any(flags)}


def _start(run: Path, over: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lmforge", "train", "--run-dir", str(run), *extra, *cli_args(over)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run.parent)


def test_sigterm_mid_run_then_resume_gives_the_uninterrupted_losses(corpus_dir, tmp_path):
    """The acceptance test, through the command as a scheduler runs it (stdout and stderr piped)."""
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "train.steps": 40,
        "train.log_interval": 1,
        "train.eval_interval": 20,
        "train.checkpoint_interval": 0,
        "train.deterministic": True,
    }
    prepare_data(load_config(None, over).data)
    straight, run = tmp_path / "straight", tmp_path / "run"
    proc = _start(straight, over)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    # not a terminal: a plain line per log interval, each evaluation once
    assert "step 1/40 | loss " in err and "| eta " in err and "tok/s" in err
    assert (err + out).count("step 20/40 | val_loss") == 1

    proc = _start(run, over)
    deadline = time.monotonic() + 600
    while not (run / "metrics.jsonl").is_file() or len((run / "metrics.jsonl").read_text().splitlines()) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 5"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    step = latest_checkpoint(run)
    assert step is not None and 5 <= int(step.name.split("_")[1]) < 40
    assert f"continue with: lmforge train --resume --run-dir {run}" in out and "(SIGTERM)" in out
    proc = _start(run, {}, "--resume")  # no flags: the run's own config
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert _losses(run) == _losses(straight)


# -- output that tells the truth ---------------------------------------------------------------------


def test_terminal_shows_each_evaluation_once(tiny_config, tmp_path, capsys, caplog):
    """On a terminal the bar prints validation lines; nothing else reports them (no second copy)."""
    with caplog.at_level(logging.INFO, logger="lmforge"):
        train(tiny_config, tmp_path / "run", progress_bar=True)
    shown = capsys.readouterr()
    assert (shown.out + shown.err).count("val_loss") == 2  # steps 10 and 20
    assert "step 10/20 | val_loss" in shown.out
    assert "val_loss" not in caplog.text


def test_eta_and_duration_formulas():
    # approx's default rel 1e-6: a float64 formula against its hand value, rounding only
    assert eta_seconds(10, 0.5, 20.0, 40) == pytest.approx(10 * (0.5 + 0.5))
    assert eta_seconds(0, 1.0, 5.0, 0) == 0
    assert [format_duration(s) for s in (7, 125, 3725)] == ["7s", "2m05s", "1h02m"]


class Sleep(Callback):
    """Pauses after step ``step`` (as a slow evaluation or checkpoint would) and records step times."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds
        self.step_time: dict[int, float] = {}

    def on_step_end(self, trainer, result) -> None:
        self.step_time[trainer.progress.step] = trainer.step_time_s
        if trainer.progress.step == self.step:
            time.sleep(self.seconds)


def test_tokens_per_s_counts_training_time_only(tiny_config, tmp_path):
    """A 1 s pause outside the steps does not enter the throughput of the window it falls in; the ETA
    spreads it over the steps done instead of jumping."""
    cfg = tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"eval_interval": 0})})
    pause = Sleep(10, 1.0)
    train(cfg, tmp_path / "run", progress_bar=False, callbacks=[pause])
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    by_step = {x["step"]: x for x in lines if "tokens_per_s" in x}
    window = sum(pause.step_time[s] for s in range(11, 16))
    # float64: the 5 step times summed in the trainer and here, one division (~1e-16); rel 1e-9 is room
    assert by_step[15]["tokens_per_s"] == pytest.approx(5 * 4 * 32 / window, rel=1e-9)
    longest = max(pause.step_time[s] for s in range(2, 16))
    assert by_step[15]["eta_s"] < 5 * longest + 5 / 15 * (1.0 + 1.0)  # pause / 3, plus a second of margin


# -- warnings before training ------------------------------------------------------------------------


def test_preflight_checks():
    assert check_validation(100, 100_000) is None
    assert "validation split holds 3 documents" in check_validation(3, 100_000)
    assert check_validation(100, 1_000).startswith("data.val_fraction:")
    assert check_epochs(100, 1000, 50_000) is None
    assert "read the 10,000 training tokens 10.0 times" in check_epochs(100, 1000, 10_000)
    assert check_vocab(512, 512) is None and check_vocab(8000, 3000).startswith("data.vocab_size:")
    assert check_sample_prompt("def ", "x = 1\ndef f(): pass") is None
    assert check_sample_prompt("Chapter 1", "def f(): pass").startswith("train.sample_prompt:")


def test_preflight_on_a_real_run(tiny_config, caplog):
    data = prepare_data(tiny_config.data)
    found = preflight(tiny_config, data, 128)  # 20 steps: only the tiny validation split is worth a word
    assert [w.split(":")[0] for w in found] == ["data.val_fraction"]
    over = tiny_config.model_copy(
        update={
            "train": tiny_config.train.model_copy(update={"steps": 100_000, "sample_prompt": "Chapter 1"})
        }
    )
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        found = preflight(over, data, 128)
    assert [w.split(":")[0] for w in found] == ["data.val_fraction", "train.steps", "train.sample_prompt"]
    assert caplog.text.count("train.steps:") == 1
    prompt = default_sample_prompt(data.val, data.tokenizer)
    assert prompt and "\n" not in prompt
    first = data.val[0]
    assert data.tokenizer.decode(first.tokens[first.offsets[0] + 1 : first.offsets[1]].tolist()).startswith(
        prompt
    )


def test_preflight_warns_of_a_smaller_tokenizer_and_a_small_validation_split(corpus_dir, tmp_path):
    over = tiny_overrides(corpus_dir, tmp_path / "data") | {
        "data.vocab_size": 60_000,
        "data.val_fraction": 0.01,
    }
    cfg = load_config(None, over)
    found = preflight(cfg, prepare_data(cfg.data), 128)
    assert [w.split(":")[0] for w in found] == ["data.val_fraction", "data.vocab_size"]


# -- generate checks its arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "-2"], "--top-k"),
        (["--max-new-tokens", "-3"], "--max-new-tokens"),
        (["--num-samples", "0"], "--num-samples"),
        (["--temperature", "nan"], "--temperature"),
    ],
)
def test_generate_refuses_bad_arguments(tmp_path, capsys, args, flag):
    code, _, err = run_cli(capsys, "generate", str(tmp_path), *args)
    assert code == 2 and err.startswith(f"lmforge generate: error: {flag}: ") and err.count("\n") == 1
