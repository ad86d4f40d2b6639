"""Differential checkpoints (``train.checkpoint_full_every``, ``train/checkpoint.py``): restored bitwise,
smaller where tensors stay unchanged, never left without their base, and a resume from one continues as
the uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.errors import UserError
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import (
    Differential,
    checkpoint_dir,
    digests,
    list_checkpoints,
    load_checkpoint,
    load_tensors,
    newest_valid_checkpoint,
    prune,
    read_differential,
    save_checkpoint,
    unchanged_keys,
)
from lmforge.train.launch import train
from lmforge.train.runtime import rng_state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _state(step: int, frozen: torch.Tensor) -> dict:
    """A training state: a trained matrix and its moment that change each step, a frozen matrix."""
    g = torch.Generator().manual_seed(step)
    trained = torch.randn(32, 32, generator=g)
    trained[0, 0] = -0.0  # bitwise: the sign of zero must survive
    return {
        "model": {"trained": trained, "frozen": frozen},
        "optimizer": {
            "state.trained.exp_avg": torch.randn(32, 32, generator=g),
            "param_groups.trained.lr": 0.1,
        },
        "rng": rng_state(),
        "progress": {"step": step},
    }


def _data_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.distcp"))


def test_differential_save_restores_bitwise_and_writes_only_what_changed(tmp_path):
    frozen = torch.randn(128, 128, dtype=torch.float64)
    first = _state(1, frozen)
    save_checkpoint(tmp_path, 1, first, "", keep=5)
    base = digests({k: first[k] for k in ("model", "optimizer")})
    second = _state(2, frozen)
    now = digests({k: second[k] for k in ("model", "optimizer")})
    same = unchanged_keys(now, base)
    assert same == {"model.frozen"}  # the two changed tensors differ; the lr is no tensor: always written
    save_checkpoint(tmp_path, 2, second, "", keep=5, differential=Differential("step_00000001", same))
    folder = checkpoint_dir(tmp_path) / "step_00000002"
    assert read_differential(folder) == Differential("step_00000001", frozenset({"model.frozen"}))
    got = load_checkpoint(folder)
    for part in ("model", "optimizer"):
        assert set(got[part]) == set(second[part])
        for key, value in second[part].items():
            if isinstance(value, torch.Tensor):
                assert got[part][key].dtype == value.dtype and torch.equal(
                    _bits(got[part][key]), _bits(value)
                )
            else:
                assert got[part][key] == value
    # into a template in place (the resume path): the same bytes
    template = {"model": {k: torch.zeros_like(v) for k, v in second["model"].items()}, "optimizer": {}}
    template["optimizer"] = {"state.trained.exp_avg": torch.zeros(32, 32), "param_groups.trained.lr": 0.0}
    load_tensors(folder, template)
    assert torch.equal(_bits(template["model"]["frozen"]), _bits(frozen))
    assert torch.equal(_bits(template["model"]["trained"]), _bits(second["model"]["trained"]))
    assert template["optimizer"]["param_groups.trained.lr"] == 0.1
    # bytes: the full checkpoint holds 2 x 32 x 32 FP32 + 128 x 128 FP64 = 139,264 bytes of tensors, the
    # differential one only the 8,192 of the changed two, each plus DCP's framing of its entries (measured
    # 6.0 KB and 4.4 KB here: the bound 8 KB)
    full, diff = _data_bytes(checkpoint_dir(tmp_path) / "step_00000001"), _data_bytes(folder)
    assert 139_264 <= full < 139_264 + 8192 and 8_192 <= diff < 8_192 + 8192, (full, diff)


def test_retention_keeps_the_base_and_a_damaged_base_invalidates(tmp_path):
    frozen = torch.randn(16, 16)
    save_checkpoint(tmp_path, 1, _state(1, frozen), "", keep=1)
    diff = Differential("step_00000001", frozenset({"model.frozen"}))
    save_checkpoint(tmp_path, 2, _state(2, frozen), "", keep=1, differential=diff)
    save_checkpoint(tmp_path, 3, _state(3, frozen), "", keep=1, differential=diff)
    # keep=1: step 3 is kept, and step 1 because step 3 reads from it; step 2 goes
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003"]
    save_checkpoint(tmp_path, 4, _state(4, frozen), "", keep=1)  # full: the old base is no longer needed
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]
    save_checkpoint(
        tmp_path, 5, _state(5, frozen), "", keep=2, differential=Differential("step_00000004", diff.from_base)
    )
    prune(tmp_path, 2)
    # a changed byte in the base: the differential checkpoint is skipped too, the resume falls back
    data = next((checkpoint_dir(tmp_path) / "step_00000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(
        UserError, match="step_00000005: differential against step_00000004, which is damaged"
    ):
        newest_valid_checkpoint(tmp_path)


def test_resume_from_a_differential_checkpoint_is_the_uninterrupted_run(tiny_config, tmp_path):
    """LoRA (rank 4, the base frozen), FP32, checkpoints every 2 steps, one in 3 full: 8 steps straight vs
    4 + resume from the differential step 4 + 4: bitwise equal states at step 8; the differential
    checkpoints wrote only the adapters and their moments."""
    cfg = tiny_config.model_copy(deep=True)
    cfg.train.steps, cfg.train.checkpoint_interval, cfg.train.keep_checkpoints = 8, 2, 4
    cfg.train.eval_interval, cfg.train.sample_tokens = 0, 0
    cfg.train.checkpoint_full_every = 3
    cfg.lora.rank, cfg.lora.targets = 4, "all-linear"
    train(cfg, tmp_path / "a", progress_bar=False)
    train(cfg, tmp_path / "b", progress_bar=False, callbacks=[StopAfter(4)])
    assert read_differential(checkpoint_dir(tmp_path / "b") / "step_00000004").base == "step_00000002"
    train(cfg, tmp_path / "b", resume=True, progress_bar=False)
    runs = {r: checkpoint_dir(tmp_path / r) for r in "ab"}
    # a: 2 full, 4 and 6 differential, 8 full; b after its resume at 4: 6 full (a process's first), 8 differential
    assert read_differential(runs["a"] / "step_00000008") is None
    assert read_differential(runs["b"] / "step_00000008").base == "step_00000006"
    a, b = load_checkpoint(runs["a"] / "step_00000008"), load_checkpoint(runs["b"] / "step_00000008")
    for part in ("model", "optimizer"):
        assert set(a[part]) == set(b[part])
        for key, value in a[part].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(_bits(value), _bits(b[part][key])), key
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    written = {r["step"]: r for r in lines if r.get("event") == "checkpoint_written"}
    assert [written[s]["kind"] for s in (2, 4, 6, 8)] == ["full", "differential", "differential", "full"]
    assert written[4]["written_fraction"] < 0.5, written[4]
