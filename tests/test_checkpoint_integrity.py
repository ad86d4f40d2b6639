"""Checkpoint manifests and damaged checkpoints (fault injection).

A tiny FP32 run writes checkpoints at steps 5 and 10; each test damages a copy of step 10 in one way and
resumes to step 15. The resume must name the damaged file in one line, fall back to step 5, and give the
very losses of the same run with step 10 simply absent (an undamaged resume from step 5): a resume is
bitwise exact in FP32 (``tests/test_train.py::test_resume_is_bitwise_exact``), so they are compared with
``==``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import warnings
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.recipe import load_config
from lmforge.train.launch import train
from lmforge.train.resume import resume_config
from tests.conftest import cli_args, tiny_overrides
from tests.torchrun import torchrun

STEPS, MORE = 10, 15


def _overrides(corpus_dir: Path, cache: Path) -> dict:
    return tiny_overrides(corpus_dir, cache) | {
        "train.steps": STEPS,
        "train.checkpoint_interval": 5,
        "train.eval_interval": 5,
        "train.eval_tokens": 256,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
    }


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _resume(run: Path, **over) -> dict:
    cfg = resume_config(run, None, {"train.steps": MORE, **over})
    return train(cfg, run, resume=True, progress_bar=False)


def _record(run: Path) -> list[tuple]:
    """Every training and validation loss of the run, by step, as ``metrics.jsonl`` holds them."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x.get("loss"), x.get("val_loss")) for x in lines if "loss" in x or "val_loss" in x]


@pytest.fixture(scope="module")
def base(corpus_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    train(load_config(None, _overrides(corpus_dir, root / "data")), root / "run", progress_bar=False)
    return root / "run"


@pytest.fixture(scope="module")
def from_step_5(base, tmp_path_factory) -> list[tuple]:
    """The losses of the run resumed from step 5 with step 10 absent: what every fallback must give."""
    run = _copy(base, tmp_path_factory.mktemp("ref") / "run")
    shutil.rmtree(_step(run, 10))
    _resume(run)
    return _record(run)


def test_every_checkpoint_has_a_manifest_of_its_files(base):
    for step in (5, 10):
        folder = _step(base, step)
        manifest = json.loads((folder / "manifest.json").read_text())
        files = sorted(
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if p.is_file() and p.name != "manifest.json"
        )
        assert sorted(manifest["files"]) == files
        assert {".metadata", "__0_0.distcp", "trainer.pt", "config.toml", "rng/rank_00000.pt"} <= set(files)
        for rel, entry in manifest["files"].items():
            data = (folder / rel).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel


def _torn(folder: Path) -> str:
    (folder / "manifest.json").unlink()  # the write stopped before its last file
    (folder / "rng" / "rank_00000.pt").unlink()
    return "manifest.json: missing"


def _truncated(folder: Path) -> str:
    shard = folder / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return f"__0_0.distcp: {len(data) // 2} bytes, the manifest says {len(data)}"


def _flipped(folder: Path) -> str:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return "__0_0.distcp: its SHA-256 differs"


def _overwritten(folder: Path) -> str:  # head -c 1000 /dev/urandom > trainer.pt
    (folder / "trainer.pt").write_bytes(random.Random(0).randbytes(1000))
    return "trainer.pt: 1000 bytes"


@pytest.mark.parametrize("damage", [_torn, _truncated, _flipped, _overwritten], ids=lambda f: f.__name__[1:])
def test_a_damaged_checkpoint_falls_back_to_the_newest_valid_one(base, from_step_5, tmp_path, caplog, damage):
    run = _copy(base, tmp_path / "run")
    said = damage(_step(run, 10))
    with caplog.at_level(logging.INFO, logger="lmforge"):
        summary = _resume(run)
    named = [r.getMessage() for r in caplog.records if "damaged or incomplete" in r.getMessage()]
    assert len(named) == 1 and "step_00000010" in named[0] and said in named[0], named
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert resumed == [f"resumed from {_step(run, 5)} at step 5"]
    assert summary["step"] == MORE and _record(run) == from_step_5


def test_no_valid_checkpoint_stops_with_one_line_before_any_work(base, tmp_path, capsys, cli_logging):
    run = _copy(base, tmp_path / "run")
    _flipped(_step(run, 10))
    _truncated(_step(run, 5))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as done:
        main(["train", "--resume", "--run-dir", str(run), f"--train.steps={MORE}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2
    assert (
        err[-1].startswith("lmforge train: error: --resume: no valid checkpoint in")
        and "step_00000005: __0_0" in err[-1]
    )
    assert (run / "metrics.jsonl").read_text() == before  # nothing trained, nothing written


def test_checkpoints_of_an_lmforge_before_manifests(base, tmp_path, caplog):
    """Without manifests (an earlier lmforge's run) a checkpoint is checked against DCP's own index: the
    newest is used when its files are all there, with one line saying so; a short shard is still found."""
    whole = _copy(base, tmp_path / "whole")
    ref = _copy(base, tmp_path / "ref")
    for run in (whole, ref):
        for step in (5, 10):
            (_step(run, step) / "manifest.json").unlink()
    with caplog.at_level(logging.INFO, logger="lmforge"):
        _resume(whole)
    said = [r.getMessage() for r in caplog.records if "before checkpoint manifests" in r.getMessage()]
    assert said == ["checkpoint step_00000010: written by an lmforge before checkpoint manifests: files "
                    "checked against DCP's index, no checksums"]  # fmt: skip
    assert f"resumed from {_step(whole, 10)} at step 10" in caplog.text
    short = _step(ref, 10) / "__0_0.distcp"
    short.write_bytes(short.read_bytes()[:-100])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmforge"):
        _resume(ref)
    assert "__0_0.distcp" in caplog.text and "DCP's index needs" in caplog.text
    assert f"resumed from {_step(ref, 5)} at step 5" in caplog.text


@pytest.mark.distributed
def test_a_missing_ranks_shard_falls_back(corpus_dir, tmp_path, caplog):
    """Two ranks (FSDP2) write steps 5 and 10; rank 1's shard of step 10 is lost. One process resumes
    (DCP reshards): from step 5, with the losses of the same resume with step 10 absent."""
    over = _overrides(corpus_dir, tmp_path / "data") | {
        "parallel.dp_shard": 2,
        "train.tokens_per_step": 16 * 32,
    }
    run = tmp_path / "run"
    done = torchrun(2, ["-m", "lmforge", "train", "--run-dir", str(run), *cli_args(over)])
    assert done.returncode == 0, done.stderr[-4000:]
    ref = _copy(run, tmp_path / "ref")
    shutil.rmtree(_step(ref, 10))
    (_step(run, 10) / "__1_0.distcp").unlink()
    with caplog.at_level(logging.INFO, logger="lmforge"):
        _resume(run, **{"parallel.dp_shard": 1})
    assert "__1_0.distcp: missing" in caplog.text
    assert f"resumed from {_step(run, 5)} at step 5" in caplog.text
    _resume(ref, **{"parallel.dp_shard": 1})
    assert _record(run) == _record(ref)


def test_single_process_saves_and_loads_do_not_warn_of_a_missing_process_group(base, tmp_path):
    run = _copy(base, tmp_path / "run")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _resume(run, **{"train.async_checkpoint": True, "train.checkpoint_interval": 2})
    said = [str(w.message) for w in seen if "torch.distributed is disabled" in str(w.message)]
    assert said == []
    assert (_step(run, 14) / "manifest.json").is_file()  # written in the background, with its manifest
