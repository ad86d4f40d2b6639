"""The progress reporter (``lmforge/progress.py``) on a fake clock: what a long phase shows and when, piped
and on a terminal; and its use by the phases that are cheap to run here (data preparation, the DPO
reference, the sweep's scoring, the first compiled step's estimate)."""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from lmforge.progress import Progress, format_duration


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def piped(what: str, total: float | None = None, unit: str = "", **kw) -> tuple[Progress, Clock, list[str]]:
    clock, lines = Clock(), []
    return Progress(what, total, unit, tty=False, clock=clock, emit=lines.append, **kw), clock, lines


def test_piped_a_line_at_most_every_few_seconds_with_done_rate_and_time_left():
    shown, clock, lines = piped("data: tokenizing", 20, "documents", every=5)
    for _ in range(20):  # one document a second
        clock.now += 1
        shown.update()
    shown.close()
    assert lines == [
        "data: tokenizing: 20 documents",
        "data: tokenizing: 5/20 documents (25%), 1 documents/s, about 15s left",
        "data: tokenizing: 10/20 documents (50%), 1 documents/s, about 10s left",
        "data: tokenizing: 15/20 documents (75%), 1 documents/s, about 5s left",
        "data: tokenizing: 20/20 documents (100%), 1 documents/s, about 0s left",
        "data: tokenizing: done in 20s (20 documents, 1/s)",
    ]


def test_many_updates_within_the_interval_give_no_line():
    shown, clock, lines = piped("pairs", 6205, "pairs", every=5)
    for _ in range(1000):
        clock.now += 0.004  # 4 s in all
        shown.update()
    shown.close()
    assert lines == ["pairs: 6,205 pairs"]  # a short phase: its opening line only, no closing one


def test_rate_and_time_left_are_the_measured_ones():
    shown, clock, lines = piped("DPO reference log-probabilities", 6205, "pairs", every=5)
    clock.now += 72
    shown.update(300)  # the figure: 300 pairs in 72 s
    assert lines[-1] == (
        "DPO reference log-probabilities: 300/6,205 pairs (5%), 4.17 pairs/s, about 23m37s left"
    )
    assert format_duration((6205 - 300) * 72 / 300) == "23m37s"


def test_without_total_the_time_spent_and_the_expected_time_left():
    shown, clock, lines = piped("compiling the model", expected_s=60, every=5)
    assert lines == ["compiling the model, about 1m00s"]
    clock.now += 5
    shown.tick()
    clock.now += 60
    shown.tick()
    shown.close()
    assert lines[1:] == [
        "compiling the model: 5s so far, about 55s left",
        "compiling the model: 1m05s so far, taking longer than expected",
        "compiling the model: done in 1m05s",
    ]


def test_silent_opening_shows_a_phase_only_once_it_lasts():
    shown, clock, lines = piped("evaluating", opening="", every=5)
    clock.now += 3
    shown.tick()
    shown.close()
    assert lines == []
    shown, clock, lines = piped("evaluating", opening="", every=5)
    clock.now += 6
    shown.tick()
    shown.close()
    assert lines == ["evaluating: 6s so far", "evaluating: done in 6s"]


def test_a_failed_phase_is_not_said_to_be_done():
    clock, lines = Clock(), []
    shown = Progress("data: tokenizing", 10, "documents", tty=False, clock=clock, emit=lines.append)
    with pytest.raises(ValueError), shown:
        clock.now += 30
        raise ValueError("bad document")
    assert lines == ["data: tokenizing: 10 documents"]


def test_on_a_terminal_a_bar_redrawn_in_place_and_cleared():
    clock, lines, stream = Clock(), [], io.StringIO()
    shown = Progress("shards", 4, "shards", tty=True, clock=clock, emit=lines.append, stream=stream, every=5)
    for _ in range(4):
        clock.now += 2
        shown.update()
    shown.close()
    draws = stream.getvalue().split("\r\033[K")
    assert draws[0] == "" and draws[-1] == ""  # each draw replaces the line; the last clears it
    assert draws[1] == "shards [######..................] 1/4 shards (25%), 0.5 shards/s, about 6s left"
    assert draws[4].startswith("shards [########################] 4/4 shards (100%)")
    assert lines == ["shards: 4 shards", "shards: done in 8s (4 shards, 0.5/s)"]  # no progress lines


def test_ticking_keeps_a_blocking_call_visible_and_stops_with_it():
    lines: list[str] = []
    shown = Progress("blocking", tty=False, emit=lines.append, every=0.05)
    with shown.ticking(interval=0.01):
        time.sleep(0.5)  # a call that reports nothing itself
    during = len(lines)
    time.sleep(0.1)
    shown.close()
    assert during >= 3 and all(" so far" in line for line in lines[1:during])
    assert len(lines) == during + 1 and lines[-1].startswith("blocking: done in")


def test_ticking_polls_work_done_elsewhere():
    clock, lines = Clock(), []
    shown = Progress("data: pass 1/1", 3, "shards", tty=False, clock=clock, emit=lines.append, every=5)
    finished = [0]
    shown.start_ticking(interval=0.01, poll=lambda: finished[0])
    finished[0] = 2
    clock.now += 10
    deadline = time.monotonic() + 5
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    shown.close()
    assert lines[1] == "data: pass 1/1: 2/3 shards (67%), 0.2 shards/s, about 5s left"


# ---- the phases ---------------------------------------------------------------------------------------


def test_data_preparation_counts_the_documents_it_tokenizes(tiny_config, corpus_dir, caplog):
    from lmforge.data.prepare import prepare_data

    documents = len((corpus_dir / "stdlib.jsonl").read_text().splitlines())
    with caplog.at_level(logging.INFO, logger="lmforge"):
        prepare_data(tiny_config.data)
    messages = [r.getMessage() for r in caplog.records]
    assert "data: training a 512-token BPE tokenizer" in messages
    # the tokenizer's training read every document once: the tokenizing phase knows its total
    assert f"data: tokenizing: {documents} documents" in messages


def test_dpo_reference_is_shown_pair_by_pair(caplog):
    import torch

    from lmforge.posttrain.dpo_data import TokenizedPair, reference_logps
    from lmforge.precision import PrecisionPolicy

    rng = np.random.default_rng(0)
    pairs = [
        TokenizedPair(
            rng.integers(1, 50, 12), np.arange(12) > 5, rng.integers(1, 50, 10), np.arange(10) > 5, "p:1"
        )
        for _ in range(7)
    ]

    def logps(inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        return (targets >= 0).sum(dim=1).float()  # the number of response tokens

    policy = PrecisionPolicy("fp32", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="lmforge"):
        out = reference_logps(logps, pairs, 16, 3, policy)
    assert [r.getMessage() for r in caplog.records] == ["DPO reference log-probabilities: 7 pairs"]
    assert out.tolist() == [[6.0, 4.0]] * 7


def test_sweep_scores_in_shown_chunks_with_the_same_scores(caplog, monkeypatch):
    from lmforge.corpus import sweep

    calls: list[int] = []

    def score(texts):
        calls.append(len(texts))
        return np.array([len(t) for t in texts], dtype=float)

    ref = sweep.Reference("classifier", "model.npz", score)
    texts = [f"document {i} " * (i % 7 + 1) for i in range(600)]
    monkeypatch.setattr(sweep, "SCORE_CHUNK", 256)
    with caplog.at_level(logging.INFO, logger="lmforge"):
        scores = sweep._scores(ref, texts, {}, 20.0)
    assert scores == [float(len(t)) for t in texts]
    assert calls == [256, 256, 88]
    assert (
        caplog.records[0].getMessage()
        == "sweep: level 20: scoring with the reference classifier: 600 documents"
    )


def test_first_compiled_step_says_the_last_compile_time_of_that_model(tiny_config, tmp_path: Path):
    from lmforge.train.callbacks.sinks import compile_key, compiling, last_compile_s, record_compile_s

    path = tmp_path / "compile_times.json"
    key = compile_key(tiny_config, 1)
    lines: list[str] = []
    logger = logging.getLogger("lmforge.progress")
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        compiling(tiny_config, 1, path).close()
        record_compile_s(key, 73.4, path)
        compiling(tiny_config, 1, path).close()
        compiling(tiny_config, 2, path).close()  # two processes compile other graphs: no figure
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert lines == [
        "compiling the model (the first step; no earlier compile of this model timed here)",
        "compiling the model, about 1m13s (its last compile here)",
        "compiling the model (the first step; no earlier compile of this model timed here)",
    ]
    assert last_compile_s(key, path) == 73.4 and json.loads(path.read_text()) == {key: 73.4}
    path.write_text("not json")
    assert last_compile_s(key, path) is None  # a damaged file is no figure, and no error
    record_compile_s(key, 10.0, path)
    assert last_compile_s(key, path) == 10.0


@pytest.mark.parametrize("seconds,text", [(7, "7s"), (125, "2m05s"), (3725, "1h02m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_slow_training_shows_a_step_line_8_seconds_after_the_last_line():
    from lmforge.train.callbacks.sinks import slow_step_line

    # 0.6 s a step (the default on 2 idle cores): the train.log_interval lines (every 6 s) suffice
    assert slow_step_line(13, 1050, 7.9, 13, 7.8) is None
    assert slow_step_line(14, 1050, 8.0, 14, 8.4) == "step 14/1050 | 0.6 s a step | eta 10m22s"
    # 12 s a step (2 cores shared by many): a line at each step, the pace measured since the compile
    assert slow_step_line(13, 1050, 12.0, 3, 36.0) == "step 13/1050 | 12.0 s a step | eta 3h27m"
    assert format_duration(12.0 * (1050 - 13)) == "3h27m"
    assert slow_step_line(1050, 1050, 12.0, 3, 36.0) is None  # the last step: the final lines follow
