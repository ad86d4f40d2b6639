"""The training dashboard (``/runs``): real tiny runs read through its API (rows, curves, marks, config
differences, byte-offset reads), run parameters outside RUNS_DIR refused, and in a real browser the runs
table, overlaid curves with their marks and config diff, and a run's new steps appearing live while a
real ``lmforge train`` writes them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.recipe import load_config, load_saved_config
from lmforge.report.runs import open_run
from lmforge.train.launch import train
from lmforge.web.app import create_app
from lmforge.web.run_files import LIVE_WINDOW_S, list_runs, read_new_records, shown_status
from tests.conftest import cli_args, screenshot, tiny_overrides, wait_render

SRC = Path(__file__).resolve().parents[1] / "src"
COMMON = {
    "train.steps": 24,
    "train.log_interval": 1,
    "train.eval_interval": 8,
    "train.checkpoint_interval": 0,
    "train.sample_tokens": 0,
    "metrics.detail_interval": 4,
}
# a mixture that switches from domain a to domain b after step 12
PHASES = [{"until_step": 12, "weights": {"a": 1}}, {"name": "anneal", "weights": {"b": 1}}]
# a tight spike rule (mean + 0.5 std of the last 6 losses): this run's own noisy losses trip it
SPIKY = {"optim.lr": 1e-2, "guard.spike_sigmas": 0.5, "guard.spike_min_history": 3, "guard.spike_window": 6}


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path, tmp_path_factory) -> Path:
    """The test corpus, whole and split into two domain files ``a`` and ``b``."""
    root = tmp_path_factory.mktemp("runs_corpus")
    lines = (corpus_dir / "stdlib.jsonl").read_text().splitlines()
    cut = 2 * len(lines) // 3
    (root / "stdlib.jsonl").write_text("\n".join(lines) + "\n")
    (root / "a.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    (root / "b.jsonl").write_text("\n".join(lines[cut:]) + "\n")
    return root


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """One prepared-data folder for every run of this module (the tokenizer is trained once per source)."""
    return tmp_path_factory.mktemp("dash_data")


@pytest.fixture(scope="module")
def runs(corpus: Path, data_cache: Path, tmp_path_factory) -> Path:
    """RUNS_DIR with two finished 24-step runs: ``mix`` (two mixture phases, boundary after step 12) and
    ``plain`` (a higher learning rate and a tight spike rule: real guard skips)."""
    root = tmp_path_factory.mktemp("dash")
    base = tiny_overrides(corpus, data_cache) | COMMON
    mix = base | {
        "data.sources": [
            {"path": str(corpus / "a.jsonl"), "domain": "a"},
            {"path": str(corpus / "b.jsonl"), "domain": "b"},
        ],
        "data.phases": PHASES,
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(load_config(None, mix), root / "runs" / "mix", progress_bar=False)
        train(load_config(None, base | SPIKY), root / "runs" / "plain", progress_bar=False)
    finally:
        torch.set_num_threads(threads)
    return root / "runs"


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _get(client, url: str, **params):
    r = client.get(url, query_string=params)
    return r.status_code, r.get_json()


# ---- API ------------------------------------------------------------------------------------------------


def test_runs_api_lists_runs_with_status_and_figures(runs: Path):
    client = create_app(runs).test_client()
    code, body = _get(client, "/api/runs")
    assert code == 200
    rows = {r["run"]: r for r in body["runs"]}
    assert sorted(rows) == ["mix", "plain"]
    for name, row in rows.items():
        run = open_run(runs / name)
        steps, losses = run.series("step", "loss")
        vals = run.series("eval", "val_loss")[1]
        assert row["status"] == "finished" and row["steps"] == 24 and steps[-1] == 24
        assert row["last_loss"] == losses[-1]
        assert row["best_val_loss"] == min(vals) and row["best_val_step"] in (8, 16, 24)
        assert "path" not in row  # no absolute path leaves the server


def test_metrics_api_gives_the_curves_marks_and_warmup(runs: Path):
    client = create_app(runs).test_client()
    code, plain = _get(client, "/api/runs/metrics", run="plain")
    assert code == 200 and plain["start"] and not plain["more"]
    assert plain["offset"] == (runs / "plain" / "metrics.jsonl").stat().st_size
    run = open_run(runs / "plain")
    lines = {ln["key"]: ln for chart in plain["series"].values() for ln in chart}
    for kind, key in [("step", "loss"), ("eval", "val_loss"), ("step", "lr"), ("step", "grad_norm")]:
        steps, values = run.series(kind, key)
        assert (lines[f"{kind}:{key}"]["x"], lines[f"{kind}:{key}"]["y"]) == (steps, values)
    assert run.series("detail", "param_norm")[0] == [4, 8, 12, 16, 20, 24]
    assert lines["detail:param_norm"]["y"] == run.series("detail", "param_norm")[1]
    entropy = [ln["label"] for ln in plain["series"]["attn_entropy"]]
    assert entropy == ["layer 0", "layer 1", "mean"]  # model.n_layers = 2

    events = [(m["step"], m["label"]) for m in plain["marks"] if m["kind"] == "event"]
    expected = [
        (e["step"], e["event"])
        for e in _records(runs / "plain")
        if e.get("event", "checkpoint") != "checkpoint"
    ]
    assert events == expected and len(events) >= 1 and {e for _, e in events} == {"skip_spike"}

    # the warmup ends at schedule.warmup = 5: the lr of step 5 is the run's peak, step 4's below it
    (warm,) = [m["step"] for m in plain["marks"] if m["kind"] == "warmup"]
    steps, lrs = run.series("step", "lr")
    assert warm == 5 == load_saved_config(runs / "plain" / "config.toml").schedule.warmup
    assert lrs[steps.index(5)] == max(lrs) > lrs[steps.index(4)]

    _, mix = _get(client, "/api/runs/metrics", run="mix")
    phases = [(m["step"], m["label"]) for m in mix["marks"] if m["kind"] == "phase"]
    assert phases == [(13, "phase: anneal")]  # phase 0 holds steps 1..12
    assert mix["phase"] == 1


def test_metrics_api_reads_only_complete_new_lines(runs: Path, tmp_path: Path):
    """A run being written: the page's offsets give every record once, never half a line, and a replaced
    file (a resume rewrites metrics.jsonl) starts again from 0."""
    live = tmp_path / "runs" / "growing"
    live.mkdir(parents=True)
    shutil.copy(runs / "plain" / "config.toml", live / "config.toml")
    data = (runs / "plain" / "metrics.jsonl").read_bytes()
    client = create_app(tmp_path / "runs").test_client()
    got, offset, file, phase = [], 0, "", -1
    cuts = [0, 10, len(data) // 3, len(data) // 3 + 5, len(data) - 7, len(data)]
    for cut in cuts:
        (live / "metrics.jsonl").write_bytes(data[:cut])  # same inode: written in place
        code, a = _get(client, "/api/runs/metrics", run="growing", offset=offset, file=file, phase=phase)
        assert code == 200 and not a["reset"] and a["offset"] <= cut
        assert a["offset"] == data[:cut].rfind(b"\n") + 1  # up to the last complete line
        got += [(ln["key"], x) for chart in a["series"].values() for ln in chart for x in ln["x"]]
        offset, file, phase = a["offset"], a["file"], a["phase"]
    _, whole = _get(client, "/api/runs/metrics", run="growing")
    assert sorted(got) == sorted(
        (ln["key"], x) for c in whole["series"].values() for ln in c for x in ln["x"]
    )
    (live / "metrics.jsonl").unlink()
    (live / "metrics.jsonl").write_bytes(data[: len(data) // 2])  # a new file: another inode
    _, again = _get(client, "/api/runs/metrics", run="growing", offset=offset, file=file)
    assert again["reset"] and again["start"] and again["offset"] == data[: len(data) // 2].rfind(b"\n") + 1


def test_config_diff_api_names_the_differing_keys(runs: Path):
    client = create_app(runs).test_client()
    code, body = _get(client, "/api/runs/diff", run=["mix", "plain"])
    assert code == 200 and body["runs"] == ["mix", "plain"]
    diff = body["differences"]
    assert diff["optim.lr"] == [3e-3, 1e-2] and diff["guard.spike_sigmas"] == [6.0, 0.5]
    assert "data.phases" in diff and "model.d_model" not in diff
    assert _get(client, "/api/runs/diff", run=["mix", "mix"])[1]["differences"] == {}


@pytest.mark.parametrize(
    ("url", "params", "needle"),
    [
        ("/api/runs/metrics", {"run": "../mix"}, "run"),
        ("/api/runs/metrics", {"run": "mix/../../x"}, "run"),
        ("/api/runs/metrics", {"run": "/etc"}, "run"),
        ("/api/runs/metrics", {"run": "out"}, "run"),  # a symbolic link out of RUNS_DIR
        ("/api/runs/metrics", {"run": "mix/checkpoints"}, "run"),  # not a run folder
        ("/api/runs/metrics", {}, "run"),
        ("/api/runs/metrics", {"run": "mix", "offset": "-1"}, "offset"),
        ("/api/runs/metrics", {"run": "mix", "file": "../x"}, "file"),
        ("/api/runs/diff", {"run": ["mix", "../mix"]}, "run"),
        ("/api/runs/diff", {}, "run"),
    ],
)
def test_run_parameters_outside_runs_dir_are_refused(runs: Path, tmp_path: Path, url, params, needle):
    # a second RUNS_DIR whose entries are symbolic links to run folders outside it
    root = tmp_path / "runs"
    root.mkdir()
    os.symlink(runs / "mix", root / "out")
    os.symlink(runs / "plain", root / "plain")
    client = create_app(root if params.get("run") == "out" else runs).test_client()
    code, body = _get(client, url, **params)
    assert code == 400 and len(body["error"].splitlines()) == 1 and body["error"].startswith(needle), body
    assert list_runs(root) == []  # links out are not listed either


def test_list_runs_two_levels_and_shown_status(tmp_path: Path):
    for rel in ("a", "group/b", "group/c/too_deep", "a/checkpoints/step_1"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "config.toml").write_text("")
    (tmp_path / "empty").mkdir()
    assert list_runs(tmp_path) == ["a", "group/b"]
    now = 1000.0
    assert shown_status("running-or-incomplete", now - 1, now) == "running"
    assert shown_status("running-or-incomplete", now - LIVE_WINDOW_S - 1, now) == "incomplete"
    assert shown_status("finished", now, now) == "finished" and shown_status("stopped", 0, now) == "stopped"
    chunk = read_new_records(tmp_path / "a" / "metrics.jsonl", 0)
    assert chunk.records == [] and chunk.offset == 0


# ---- browser --------------------------------------------------------------------------------------------


LOSS_POINTS = "((document.getElementById('chart-loss').data || [])[0] || {x: []}).x.length"


def _traces(page, chart: str) -> list[dict]:
    return page.evaluate(
        f"document.getElementById('chart-{chart}').data.map(t => ({{name: t.name, n: t.x.length}}))"
    )


def test_dashboard_overlays_runs_with_marks_and_config_diff(runs: Path, serve, page, tmp_path: Path):
    url = serve(runs)
    page.goto(f"{url}/runs")
    wait_render(page)
    for name in ("mix", "plain"):
        assert page.get_attribute(f"[data-key='status:{name}']", "data-value") == "finished"
        assert page.get_attribute(f"[data-key='steps:{name}']", "data-value") == "24"
    checked = page.locator("input[name=sel]:checked").evaluate_all("els => els.map(e => e.value)")
    assert len(checked) == 1  # none running: the most recently written run
    loss = _traces(page, "loss")
    assert {"train": 24, "validation": 3}.items() <= {t["name"]: t["n"] for t in loss}.items()

    n = int(page.evaluate("document.body.dataset.renders"))
    for name in ("mix", "plain"):
        page.check(f"input[name=sel][value='{name}']")
    wait_render(page, after=n)
    page.wait_for_selector("#diff tr[data-key='optim.lr']")
    names = {t["name"] for t in _traces(page, "loss")}
    assert {"mix: train", "plain: train", "mix: validation", "plain: validation"} <= names
    assert {"mix: layer 0", "plain: layer 1"} <= {t["name"] for t in _traces(page, "attn_entropy")}
    assert page.get_attribute("[data-key='diff:optim.lr:plain']", "data-value") == "0.01"
    labels = page.evaluate("document.getElementById('chart-loss').layout.annotations.map(a => a.text)")
    assert "skip_spike" in labels and "phase: anneal" in labels and "warmup ends" in labels
    spikes = [e["step"] for e in _records(runs / "plain") if e.get("event") == "skip_spike"]
    rows = page.locator("#marks tr[data-kind='event']").evaluate_all("els => els.map(e => +e.dataset.step)")
    assert rows == spikes
    assert page.locator("#marks tr[data-kind='phase'][data-run='mix'][data-step='13']").count() == 1
    screenshot(page, "runs", tmp_path)


def test_dashboard_shows_a_running_run_live(
    runs: Path, corpus: Path, data_cache: Path, serve, page, tmp_path: Path
):
    """A real ``lmforge train`` in a subprocess, started after the page was opened: the page lists it as
    running, ticks it, shows its steps growing, then the final step and ``finished``, without reloading."""
    root = tmp_path / "runs"
    root.mkdir()
    page.goto(f"{serve(root, poll_ms=300)}/runs")
    wait_render(page)
    assert page.locator("#runs-table tbody tr").count() == 0
    steps = 300
    # the data prepared for the run ``plain`` (same source and tokenizer settings): no preparation here
    over = tiny_overrides(corpus, data_cache) | COMMON | {"train.steps": steps, "train.eval_interval": 0}
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "train", "--run-dir", str(root / "live"), *cli_args(over)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status, key = "[data-key='status:live']", "[data-key='steps:live']"
        page.wait_for_selector(status, timeout=60000)
        t_listed = time.monotonic() - t0
        assert page.get_attribute(status, "data-value") == "running"
        assert page.is_checked("input[name=sel][value='live']")  # started while the page was open: followed
        seen = [int(page.get_attribute(key, "data-value") or 0)]  # "" before the first record
        points = []
        while len(seen) < 3:  # two increases seen while the run is running
            page.wait_for_function(
                f'Number(document.querySelector("{key}").dataset.value) > {seen[-1]}', timeout=30000
            )
            seen.append(int(page.get_attribute(key, "data-value")))
            points.append(page.evaluate(LOSS_POINTS))  # the chart's fetch may still be under way: 0
            assert seen[-1] < steps, f"the run ended before the page saw it grow twice ({seen}): more steps"
        page.wait_for_function(f"{LOSS_POINTS} > {max(points)}", timeout=10000)  # the loss curve grows ...
        assert int(page.evaluate("document.body.dataset.extended || 0")) > 0  # ... by Plotly.extendTraces
        assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # never reloaded
        page.wait_for_function(
            f"document.querySelector(\"{status}\").dataset.value === 'finished'", timeout=40000
        )
        t_done = time.monotonic() - t0
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
        assert page.get_attribute(key, "data-value") == str(steps)
        page.wait_for_function(
            f"document.getElementById('chart-loss').data[0].x.length === {steps}", timeout=5000
        )
        loss_x = page.evaluate("document.getElementById('chart-loss').data[0].x")
        assert loss_x == list(range(1, steps + 1))  # every step once, in order
        # it grew past 20 points by extensions: its markers went (a series of few points has them)
        assert page.evaluate("document.getElementById('chart-loss').data[0].mode") == "lines"
        print(f"live: listed after {t_listed:.1f} s, finished {t_done:.1f} s, steps {seen}, points {points}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dashboard_run_without_records_is_running_then_incomplete(runs: Path, serve, page, tmp_path: Path):
    """A run folder with only its config.toml (a run starting): running while the file is fresh, shown
    incomplete once it is older than the live window, with no errors and empty charts meanwhile."""
    root = tmp_path / "runs"
    (root / "fresh").mkdir(parents=True)
    shutil.copy(runs / "mix" / "config.toml", root / "fresh" / "config.toml")
    page.goto(f"{serve(root, poll_ms=200)}/runs")
    wait_render(page)
    status = "[data-key='status:fresh']"
    assert page.get_attribute(status, "data-value") == "running"
    assert page.get_attribute("[data-key='steps:fresh']", "data-value") == ""
    assert _traces(page, "loss") == []
    old = time.time() - LIVE_WINDOW_S - 10
    os.utime(root / "fresh" / "config.toml", (old, old))
    page.wait_for_function(
        f"document.querySelector(\"{status}\").dataset.value === 'incomplete'", timeout=5000
    )


def test_a_series_of_few_points_is_drawn_with_markers(serve, page, tmp_path: Path):
    """A run under 100 steps has one detail record (``metrics.detail_interval=50``): its attention entropy
    and parameter norm are one point each, which a bare line does not show; they get markers, and a long
    series (60 training losses) stays a plain line."""
    run = tmp_path / "runs" / "short"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nsteps = 60\n")
    records = [
        {"step": s, "loss": 5.0 - s / 100, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 9.0}
        for s in range(1, 61)
    ]
    records.append(
        {"step": 50, "detail": True, "param_norm": 30.0, "attn_entropy/layer.0": 1.5, "attn_entropy": 1.4}
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page.goto(f"{serve(tmp_path / 'runs')}/runs")
    wait_render(page)
    page.wait_for_function("(document.getElementById('chart-attn_entropy').data || []).length === 2")
    modes = page.evaluate(
        "Object.fromEntries(['loss', 'norms', 'attn_entropy'].flatMap(c =>"
        " document.getElementById('chart-' + c).data.map(t => [c + ':' + t.name, [t.mode, t.x.length]])))"
    )
    assert modes == {
        "loss:train": ["lines", 60],
        "norms:gradient": ["lines", 60],
        "norms:parameters": ["lines+markers", 1],
        "attn_entropy:layer 0": ["lines+markers", 1],
        "attn_entropy:mean": ["lines+markers", 1],
    }


def _task_run(root: Path) -> Path:
    """A run folder of 6 steps whose ``[eval]`` scored the task ``bisect`` at steps 2, 4 and 6 and flagged
    a regression at step 6 (records as ``TaskEvaluation`` writes them)."""
    run = root / "tasks"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("[train]\nsteps = 6\n")
    records = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "tokens_per_s": 9.0} for s in range(1, 7)]
    records += [
        {"step": s, "task/bisect/acc": a, "task/bisect/acc_stderr": 0.1}
        for s, a in ((2, 0.5), (4, 0.6), (6, 0.3))
    ]
    records.append(
        {"event": "task_regression", "step": 6, "task": "bisect", "metric": "acc", "value": 0.3, "best": 0.6}
    )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_task_scores_are_a_chart_and_regressions_marks(tmp_path: Path, serve, page):
    """The API gives the task scores as the tasks chart's line (standard errors left out) and the
    regression as an event mark; the browser draws both."""
    _task_run(tmp_path / "runs")
    code, body = _get(create_app(tmp_path / "runs").test_client(), "/api/runs/metrics", run="tasks")
    assert code == 200
    assert body["series"]["tasks"] == [
        {"key": "task:task/bisect/acc", "label": "bisect/acc", "x": [2, 4, 6], "y": [0.5, 0.6, 0.3]}
    ]
    (mark,) = [m for m in body["marks"] if m["kind"] == "event"]
    assert (mark["step"], mark["label"]) == (6, "task_regression") and "best=0.6" in mark["text"]
    page.goto(f"{serve(tmp_path / 'runs')}/runs")
    wait_render(page)
    page.wait_for_function("(document.getElementById('chart-tasks').data || []).length === 1")
    assert _traces(page, "tasks") == [{"name": "bisect/acc", "n": 3}]
    labels = page.evaluate("document.getElementById('chart-loss').layout.annotations.map(a => a.text)")
    assert "task_regression" in labels
    assert page.locator("#marks tr[data-kind='event'][data-label='task_regression']").count() == 1
