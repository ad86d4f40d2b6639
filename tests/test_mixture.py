from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import DataConfig
from lmforge.data.loader import PackedLoader, TokenStream
from lmforge.data.mixture import (
    MixtureLoader,
    Phase,
    build_train_loader,
    check_domains,
    planned_epochs,
    resolve_phases,
)
from lmforge.data.prepare import prepare_data
from lmforge.data.shards import Shard
from lmforge.errors import ConfigError
from lmforge.probes.lr_find import sweep, sweep_run
from lmforge.recipe import load_config, to_toml
from lmforge.train.build import build_run
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.callbacks.metrics import MEASURED_KEYS
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

BASE = {"a": 0, "b": 100_000, "c": 200_000}  # token values encode the domain: value // 100_000


def _streams(tokens: dict[str, int], doc_len: int = 5) -> dict[str, TokenStream]:
    out = {}
    for d, n in tokens.items():
        toks = np.arange(BASE[d], BASE[d] + n, dtype=np.uint32)
        out[d] = TokenStream([Shard(toks, np.arange(0, n + 1, doc_len, dtype=np.int64))])
    return out


def _loader(phases, sizes=None, mbs=5, seqs_per_step=5, rank=0, world=1, seed=3) -> MixtureLoader:
    streams = _streams(sizes or {"a": 8001, "b": 4001, "c": 161})
    return MixtureLoader(streams, phases, seqs_per_step, 8, mbs, seed, rank, world)


def _domains(batch) -> list[str]:
    return ["abc"[int(v) // 100_000] for v in batch.inputs[:, 0]]


def test_mix_follows_weights_over_10000_sequences():
    target = {"a": 0.6, "b": 0.3, "c": 0.1}
    loader = _loader([Phase("p", None, tuple(target.values()))], mbs=50, seqs_per_step=50)
    drawn, worst, first = {d: 0 for d in target}, 0.0, None
    for _ in range(200):  # 200 x 50 = 10,000 sequences
        batch = loader.next_batch()
        first = batch.inputs if first is None else first
        for d in _domains(batch):
            drawn[d] += 1
        n = sum(drawn.values())
        worst = max(worst, *(abs(drawn[d] - target[d] * n) for d in target))
    for d, w in target.items():  # implied by worst < 1 (1 in 10,000); 0.01 is a loose restatement, not noise
        assert abs(drawn[d] / 10_000 - w) < 0.01, (d, drawn)
    assert worst < 1.0  # after every batch, each domain is within one sequence of its target count
    # c has (161 - 1) // 8 = 20 windows: 1,000 sequences are 50 epochs of it (upsampled by repetition)
    # a float64 ratio of counts: pytest.approx's default is rounding room (here and below)
    assert loader.domain_epochs()["c"] == pytest.approx(50.0) and loader.cursor.tolist() == [6000, 3000, 1000]
    again = _loader([Phase("p", None, tuple(target.values()))], mbs=50, seqs_per_step=50)
    assert torch.equal(again.next_batch().inputs, first)  # a pure function of (seed, position)


def test_small_domain_repeats_each_window_once_per_epoch_reshuffled():
    loader = _loader([Phase("p", None, (0.0, 0.0, 1.0))], mbs=20, seqs_per_step=20)
    epochs = [[int(v) - BASE["c"] for v in loader.next_batch().inputs[:, 0]] for _ in range(3)]
    for order in epochs:  # window c starts at token c * 8: each epoch is a permutation of all 20
        assert sorted(order) == [8 * i for i in range(20)]
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = MixtureLoader(_streams({"a": 8001, "b": 4001, "c": 161}), loader.phases, 20, 8, 20, 4)
    assert [int(v) - BASE["c"] for v in other_seed.next_batch().inputs[:, 0]] != epochs[0]


def test_phases_switch_at_their_step_and_resume_restores_the_next_sequence_per_domain():
    phases = [Phase("warm", 4, (0.5, 0.5, 0.0)), Phase("anneal", None, (0.0, 0.2, 0.8))]
    straight = _loader(phases)  # 5 sequences per step, one micro-batch per step
    batches = [straight.next_batch() for _ in range(8)]
    assert [straight.phases[p].name for p in (0, 1)] == ["warm", "anneal"]
    drawn = [d for b in batches for d in _domains(b)]
    assert sorted(drawn[:20]) == ["a"] * 10 + ["b"] * 10 and "a" not in drawn[20:]
    assert straight.report()["phase"] == 1
    stopped = _loader(phases)
    for _ in range(3):  # stop one step before the boundary
        stopped.next_batch()
    state = json.loads(json.dumps(stopped.state_dict()))  # survives serialisation as it is
    resumed = _loader(phases)
    resumed.load_state_dict(state)
    assert resumed.cursor.tolist() == stopped.cursor.tolist()
    for want in batches[3:]:
        assert torch.equal(resumed.next_batch().inputs, want.inputs)
    assert resumed.cursor.tolist() == straight.cursor.tolist()
    assert resumed.state_dict() == straight.state_dict()


def test_ranks_take_disjoint_blocks_of_the_same_mixture():
    phases = [Phase("p", 3, (0.5, 0.3, 0.2)), Phase("q", None, (0.1, 0.1, 0.8))]
    r0 = _loader(phases, mbs=3, seqs_per_step=6, rank=0, world=2)
    r1 = _loader(phases, mbs=3, seqs_per_step=6, rank=1, world=2)
    single = _loader(phases, mbs=6, seqs_per_step=6)
    for _ in range(6):
        a, b, both = r0.next_batch(), r1.next_batch(), single.next_batch()
        assert torch.equal(torch.cat([a.inputs, b.inputs]), both.inputs)
        assert torch.equal(torch.cat([a.doc_ids, b.doc_ids]), both.doc_ids)
    assert r0.cursor.tolist() == r1.cursor.tolist() == single.cursor.tolist()


def test_resolve_phases_weights_and_boundaries():
    windows = {"code": 300, "prose": 100}
    cfg = DataConfig(
        phases=[
            {"until_tokens": 1000, "weights": {"code": 3, "prose": 1}},
            {"until_step": 20},
            {"name": "anneal", "weights": {"prose": 2}},
        ]
    )
    p = resolve_phases(cfg, windows, tokens_per_step=64, steps=30)
    assert [x.end_step for x in p] == [16, 20, None]  # ceil(1000 / 64) = 16
    assert p[0].weights == (0.75, 0.25) and p[1].weights == (0.75, 0.25)  # size-proportional: 300:100
    assert p[2].weights == (0.0, 1.0) and p[2].name == "anneal" and p[1].name == "phase1"
    # 2 sequences per step: 32, 8 and 20 sequences in the three phases (float64 ratios: rounding room only)
    assert planned_epochs(p, windows, 2, 30) == pytest.approx({"code": 30 / 300, "prose": 30 / 100})
    bad = DataConfig(phases=[{"until_step": 20}, {"until_tokens": 640}, {}])
    with pytest.raises(ConfigError, match=r"data\.phases\[1\]\.until_tokens: ends at step 10, not after"):
        resolve_phases(bad, windows, 64, 30)
    with pytest.raises(
        ConfigError, match=r"data\.weights: unknown domain 'web'; available domains: code, prose"
    ):
        resolve_phases(DataConfig(weights={"web": 1.0}), windows, 64, 30)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"data.weights": {"code": -1.0}}, "data.weights.code: weight -1.0 is negative"),
        ({"data.weights": {"code": 0.0, "prose": 0.0}}, "data.weights: weights sum to 0"),
        (
            {"data.phases": [{"until_step": 50}, {"until_step": 40}, {}]},
            "data.phases[1].until_step: 40 is not after",
        ),
        (
            {"data.phases": [{"until_step": 5, "until_tokens": 9}]},
            "data.phases[0]: give until_step or until_tokens",
        ),
        ({"data.phases": [{}, {"until_step": 5}]}, "data.phases[0]: only the last phase may omit"),
        (
            {"data.phases": [{"weights": {"code": -2}}]},
            "data.phases[0].weights.code: weight -2.0 is negative",
        ),
    ],
)
def test_bad_mixture_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, override)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_mixture_recipe_round_trips_through_toml(tmp_path):
    cfg = load_config(
        None,
        {
            "data.weights": {"code": 2.0, "web.en": 1.0},
            "data.phases": [{"until_tokens": 5000, "weights": {"web.en": 1}}, {"name": "anneal"}],
        },
    )
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_unknown_domain_fails_before_data_work_with_exit_2(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"data\.phases\[0\]\.weights: unknown domain 'docs'; available domains: code, prose",
    ):
        check_domains(load_config(None, {"data.phases": [{"weights": {"docs": 1.0}}]}).data)
    result = subprocess.run(
        [sys.executable, "-m", "lmforge", "train", "--data.weights={code=1.0, web=2.0}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert (
        len(lines) == 1 and "data.weights: unknown domain 'web'; available domains: code, prose" in lines[0]
    )
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def two_domains(corpus_dir: Path, tmp_path_factory) -> Path:
    """The test corpus split into two JSONL files, filed under domains ``a`` (larger) and ``b``."""
    root = tmp_path_factory.mktemp("two_domains")
    lines = (corpus_dir / "stdlib.jsonl").read_text().splitlines()
    cut = 2 * len(lines) // 3
    (root / "a.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    (root / "b.jsonl").write_text("\n".join(lines[cut:]) + "\n")
    return root


def _mixture_config(corpus: Path, cache: Path, **extra):
    over = tiny_overrides(corpus, cache)
    over["data.sources"] = [
        {"path": str(corpus / "a.jsonl"), "domain": "a"},
        {"path": str(corpus / "b.jsonl"), "domain": "b"},
    ]
    over.update(extra)
    return load_config(None, over)


def _final_params(run):
    return load_checkpoint(latest_checkpoint(run))["model"]


def test_training_resumes_exactly_across_a_phase_boundary(two_domains, tmp_path):
    phases = [{"until_step": 10, "weights": {"a": 3, "b": 1}}, {"name": "anneal", "weights": {"b": 1}}]
    over = {"data.phases": phases, "train.steps": 16, "train.log_interval": 4, "train.eval_interval": 0}
    cfg = _mixture_config(two_domains, tmp_path / "data", **over)
    straight = train(cfg, tmp_path / "straight", progress_bar=False)
    train(cfg, tmp_path / "resumed", progress_bar=False, callbacks=[StopAfter(8)])  # stop before the boundary
    resumed = train(cfg, tmp_path / "resumed", resume=True, progress_bar=False)  # ... and go past it
    a, b = _final_params(tmp_path / "straight"), _final_params(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == straight["val_loss"] and resumed["domains"] == straight["domains"]

    def lines(run):
        recs = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        timings = MEASURED_KEYS
        return [{k: v for k, v in r.items() if k not in timings} for r in recs if "loss" in r]

    log = lines("straight")
    assert log == lines("resumed")  # phase, mix and epochs identical across the interruption
    by_step = {r["step"]: r for r in log}
    assert [by_step[s]["phase"] for s in (4, 8, 12, 16)] == [0, 0, 1, 1]
    assert by_step[16]["phase_name"] == "anneal" and by_step[16]["mix/b"] == 1.0
    assert by_step[8]["mix/a"] == 0.75  # steps 5-8: 16 sequences, 12 of them from a
    assert by_step[12]["mix/a"] == 6 / 16  # steps 9-10 in phase 0 (a a b a a a b a), 11-12 in phase 1
    domains = json.loads((tmp_path / "straight" / "summary.json").read_text())["domains"]
    assert domains["a"]["sequences"] == 30 and domains["b"]["sequences"] == 10 + 24
    assert domains["b"]["epochs"] == pytest.approx(34 / domains["b"]["windows"])  # float64 ratio


def test_no_weights_keeps_the_plain_packed_stream(two_domains, tmp_path):
    cfg = _mixture_config(two_domains, tmp_path / "data")
    data = prepare_data(cfg.data)
    loader = build_train_loader(cfg, data, accum=1)
    plain = PackedLoader(
        TokenStream(data.train), cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.seed
    )
    assert isinstance(loader, PackedLoader)
    assert all(torch.equal(loader.next_batch().inputs, plain.next_batch().inputs) for _ in range(3))
    mixed = build_train_loader(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"weights": {"b": 1.0}})}), data, 1
    )
    assert isinstance(mixed, MixtureLoader) and mixed.domains == ["a", "b"]
    with pytest.raises(Exception, match="trained with a mixture"):
        plain.load_state_dict(mixed.state_dict())


def test_lr_find_reads_the_mixture(two_domains, tmp_path):
    """lr-find builds its run through the training build path, so it reads the configured mixture: its
    losses are those of a sweep fed by the training loader, and they change with ``data.weights``."""
    over = {"lr_find.steps": 6, "lr_find.start_lr": 1e-4, "lr_find.end_lr": 1e-2}
    only_a = _mixture_config(two_domains, tmp_path / "data", **over, **{"data.weights": {"a": 1.0}})
    only_b = _mixture_config(two_domains, tmp_path / "data", **over, **{"data.weights": {"b": 1.0}})
    got_a, got_b = sweep(only_a), sweep(only_b)
    run = build_run(only_a)
    assert isinstance(run.loader, MixtureLoader)
    ref = sweep_run(run, only_a.lr_find)
    assert got_a.losses == ref.losses
    assert got_a.losses[0] != got_b.losses[0]  # different domains, different first batch
