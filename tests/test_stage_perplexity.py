"""The ``perplexity`` stage: percentile bounds and the absolute band on known scores, the removal
records, a bad run folder stopping ``lmforge data`` before OUT exists, and a pipeline run whose kept
documents carry the score ``LMScorer`` gives them."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from lmforge.cli import main
from lmforge.corpus import readers
from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.executors import WORKERS_ENV, default_workers, threads_per_worker
from lmforge.corpus.lm_scorer import LMScorer
from lmforge.corpus.stages.perplexity import Perplexity, PerplexityParams, percentile_bounds
from lmforge.errors import ConfigError
from tests.conftest import training_texts

SCORES = [10.0, 1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 4.0, 6.0, 5.0]


@pytest.fixture(autouse=True)
def _threads():
    """One thread: these models are tiny, and a second thread only waits on a shared machine."""
    torch.set_num_threads(1)


@pytest.fixture
def run(scorer_run) -> Path:
    return scorer_run


def _plan_and_apply(run: Path, workdir: Path, scores: list[float], **params) -> tuple[dict, list]:
    """The stage's plan over documents with the given scores, then ``apply`` on each."""
    stage = Perplexity(PerplexityParams(run=str(run), **params))
    docs = [Doc(f"d{i}", "", "web", (0, 0, i)) for i in range(len(scores))]
    figures = stage.plan(iter(zip(docs, scores, strict=True)), workdir)
    return figures, [stage.apply(d, workdir) for d in docs]


def test_percentile_range_keeps_exactly_the_documents_inside_it(run, tmp_path):
    # bounds by hand: ranks 0.2 * 9 = 1.8 and 0.8 * 9 = 7.2 of the sorted scores 1..10: 2.8 and 8.2
    figures, out = _plan_and_apply(run, tmp_path, [*SCORES, math.nan], min_percentile=20, max_percentile=80)
    # percentiles of given float64 perplexities: rounding only (measured equal)
    assert figures["bounds"] == pytest.approx([2.8, 8.2])
    kept = {d.id: d.meta["perplexity"] for d in out if isinstance(d, Doc)}
    assert kept == {f"d{i}": s for i, s in enumerate(SCORES) if 3 <= s <= 8}
    drops = {f"d{i}": d for i, d in enumerate(out) if isinstance(d, Drop)}
    assert drops["d1"].reason == "perplexity.below_percentile" and drops["d1"].value == 1.0
    # the same float64 percentiles as the bounds above: approx's default rel 1e-6 is rounding room
    assert drops["d1"].threshold == pytest.approx(2.8)
    assert drops["d0"].reason == "perplexity.above_percentile" and drops["d0"].threshold == pytest.approx(8.2)
    assert drops["d10"] == Drop("perplexity.no_tokens", None, None, None)  # an empty document
    assert figures["documents"] == 11 and figures["scored"] == 10 and figures["kept"] == 6
    assert figures["removed"] == {
        "perplexity.above_percentile": 2,
        "perplexity.below_percentile": 2,
        "perplexity.no_tokens": 1,
    }


def test_ccnet_head_and_the_absolute_band(run, tmp_path):
    scores = list(np.arange(1.0, 31.0))  # 1..30: the head (33.3rd percentile) ends at 1 + 0.333 * 29
    _, out = _plan_and_apply(run, tmp_path / "head", scores, max_percentile=33.3)
    assert [d.meta["perplexity"] for d in out if isinstance(d, Doc)] == list(range(1, 11))
    _, out = _plan_and_apply(run, tmp_path / "band", SCORES, min_perplexity=2.5, max_perplexity=9.5)
    reasons = {d.reason for d in out if isinstance(d, Drop)}
    kept = sorted(d.meta["perplexity"] for d in out if isinstance(d, Doc))
    assert kept == [3, 4, 5, 6, 7, 8, 9] and reasons == {"perplexity.below_band", "perplexity.above_band"}
    assert Perplexity.filters and Perplexity.strictness[0].param == "max_percentile"
    assert (Perplexity.strictness[0].value(0), Perplexity.strictness[0].value(100)) == (100.0, 33.3)


def test_percentile_bounds_ignore_documents_without_tokens():
    assert percentile_bounds(np.array([math.nan, 4.0, 2.0]), 0, 100) == (2.0, 4.0)
    assert percentile_bounds(np.array([math.nan]), 0, 100) is None


def test_parameters_are_checked(run, tmp_path):
    with pytest.raises(ValidationError, match="min_percentile must not exceed"):
        PerplexityParams(run=str(run), min_percentile=60, max_percentile=50)
    # the run is checked when the stage is built (a recipe may name a run still to be trained)
    with pytest.raises(ConfigError, match=r"^perplexity\.run: .* is not an lmforge run folder"):
        Perplexity(PerplexityParams(run=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"^perplexity\.step: .* no checkpoint of step 7"):
        Perplexity(PerplexityParams(run=str(run), step=7))


def test_threads_default_to_the_workers_share_of_the_cores(monkeypatch):
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert threads_per_worker() == max(1, default_workers() // 2)
    monkeypatch.delenv(WORKERS_ENV)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_worker() == 3


def _recipe(tmp_path: Path, stage: str) -> Path:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[[sources]]\npath = "{tmp_path / "in.jsonl"}"\ndomain = "web"\n'
        f'[[stages]]\nname = "perplexity"\n{stage}\n[execution]\nchunk_bytes = 2048\n'
    )
    return recipe


def _cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return exc.value.code, capsys.readouterr().err


@pytest.mark.usefixtures("cli_logging")
@pytest.mark.parametrize(
    ("stage", "says"),
    [
        ('run = "{tmp}/nowhere"', "perplexity.run: {tmp}/nowhere is not an lmforge run folder"),
        ('run = "{run}"\nstep = 7', "perplexity.step: {run} has no checkpoint of step 7"),
    ],
)
def test_a_bad_run_folder_stops_lmforge_data_before_out(run, tmp_path, capsys, stage, says):
    (tmp_path / "in.jsonl").write_text('{"text": "some text"}\n')
    recipe = _recipe(tmp_path, stage.format(tmp=tmp_path, run=run))
    code, err = _cli(capsys, "data", "--config", str(recipe), "--out", str(tmp_path / "out"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert says.format(tmp=tmp_path, run=run) in err
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("cli_logging")
def test_lmforge_data_keeps_the_text_like_the_training_text_with_its_score(run, tmp_path, capsys):
    rng = random.Random(0)
    good = training_texts()
    bad = ["".join(rng.sample(t, len(t))) for t in good]  # the same characters, shuffled
    docs = [("good", t) for t in good] + [("bad", t) for t in bad]
    rng.shuffle(docs)
    with (tmp_path / "in.jsonl").open("w") as fh:
        for i, (kind, text) in enumerate(docs):
            fh.write(json.dumps({"id": f"{kind}{i}", "text": text}) + "\n")
    recipe = _recipe(tmp_path, f'run = "{run}"\nmax_percentile = 50\nbatch_size = 2\nthreads = 1')
    outs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        code, _ = _cli(
            capsys, "data", "--config", str(recipe), "--out", str(out), "--no-tokenize", "--workers", workers
        )
        assert code == 0
        outs[workers] = {
            p.name: p.read_bytes() for f in ("kept", "removed") for p in sorted((out / f).glob("*"))
        }
    assert outs["1"] == outs["2"]  # worker processes give the inline run's files
    out = tmp_path / "out1"
    kept = [r for p in sorted((out / "kept").glob("*")) for r in readers.json_records(p)]
    removed = [r for p in sorted((out / "removed").glob("*")) for r in readers.json_records(p)]
    assert sorted(r["id"][:4] for r in kept) == ["good"] * len(good)
    assert {r["reason"] for r in removed} == {"perplexity.above_percentile"} and len(removed) == len(bad)
    want = LMScorer(run).score([r["text"] for r in kept])
    # perplexity = exp(mean FP32 loss) from worker processes and from this one, batched otherwise: the loss's
    # FP32 sum order (<= 5e-6) times exp's sensitivity (the loss, ~3.4): measured 9.3e-6, 1e-4 is 10x
    np.testing.assert_allclose([r["meta"]["perplexity"] for r in kept], want, rtol=1e-4)
    bound = max(r["threshold"] for r in removed)
    assert all(r["value"] > bound for r in removed) and all(r["meta"]["perplexity"] <= bound for r in kept)
    report = json.loads((out / "report.json").read_text())
    row = next(s for s in report["stages"] if s["stage"] == "perplexity")
    # the report's bound is the drops' threshold, float64 through JSON: measured equal
    assert row["plan"]["documents"] == len(docs) and row["plan"]["bounds"][1] == pytest.approx(bound)
    assert report["shards"] > 1
