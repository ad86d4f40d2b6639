"""``lmforge plot`` and ``lmforge compare`` on real tiny runs: the panels drawn are the ones whose keys the
runs logged, the guard's events are found and marked, the PNGs are real images, and the comparison's
figures are the summaries' and its config differences exactly the keys the runs were given apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from lmforge.cli import main
from lmforge.recipe import load_config
from lmforge.report.compare import compare, differences, table_text
from lmforge.report.plots import PANELS, draw_panel, matching_keys, panel_keys, select_panels
from lmforge.report.runs import RunRecords, open_run, read_metrics
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

# a touchy guard, so that both runs log skip events (spikes over a 5-loss window)
GUARD = {
    "guard.spike_sigmas": 0.5,
    "guard.spike_min_history": 3,
    "guard.spike_window": 5,
    "guard.max_bad_steps": 1000,
    "train.log_interval": 1,
    "train.sample_tokens": 0,
    "train.eval_tokens": 256,
}


# Tolerances: the one pytest.approx (rel=1e-12) compares a mean of logged floats with the same mean taken
# here, float64 arithmetic in another order (~1e-16 relative): the CPU does not enter.


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """Two finished runs that differ in ``optim.lr`` and ``train.steps``, one stopped after step 4 and
    one killed before its first checkpoint (the stopped run's folder without checkpoints, cut short)."""
    root = tmp_path_factory.mktemp("runs")
    base = tiny_overrides(corpus_dir, root / "data") | GUARD
    out = {"a": root / "a", "b": root / "b", "stopped": root / "stopped", "killed": root / "killed"}
    train(load_config(None, base | {"train.steps": 10}), out["a"], progress_bar=False)
    train(load_config(None, base | {"train.steps": 12, "optim.lr": 1e-2}), out["b"], progress_bar=False)
    cfg = load_config(None, base | {"train.steps": 10})
    train(cfg, out["stopped"], progress_bar=False, callbacks=[StopAfter(4)])
    out["killed"].mkdir()
    shutil.copyfile(out["stopped"] / "config.toml", out["killed"] / "config.toml")
    steps = [r for r in read_metrics(out["stopped"] / "metrics.jsonl") if "tokens_per_s" in r][:3]
    text = "".join(json.dumps(r) + "\n" for r in steps) + '{"step": 4, "lo'  # its last line cut mid-way
    (out["killed"] / "metrics.jsonl").write_text(text)
    return out


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def _keys_in_file(run: Path) -> set[str]:
    return {k for r in read_metrics(run / "metrics.jsonl") for k, v in r.items() if v is not None}


def _panel_names(panel_keys_present) -> list[str]:
    return [p.name for p in panel_keys_present]


# -- plot ----------------------------------------------------------------------------------------


def test_panels_are_those_whose_keys_the_runs_logged(runs):
    loaded = [open_run(runs["a"]), open_run(runs["b"])]
    chosen = select_panels(loaded)
    names = [p.name for p in chosen]
    assert names[:3] == ["loss", "lr", "norms"] and "throughput" in names
    logged = _keys_in_file(runs["a"]) | _keys_in_file(runs["b"])
    for panel in PANELS:
        keys = {k for run in loaded for _, k, _ in panel_keys(panel, run)}
        assert keys <= logged
        assert (panel in chosen) == bool(keys), panel.name  # drawn exactly when a run has one of its keys


def test_panel_selection_on_detail_records(runs, tmp_path):
    """Detail keys (per layer, per kind) bring their panels; layers in numeric order; nulls are no data."""
    run = tmp_path / "detail"
    run.mkdir()
    shutil.copyfile(runs["a"] / "config.toml", run / "config.toml")
    records = [{"step": 1, "loss": 5.0, "tokens_per_s": 10.0}]
    records += [
        {"step": s, "detail": True, "attn_entropy/layer.10": 1.0, "attn_entropy/layer.2": 2.0 + s}
        | {"grad_norm/mlp": 0.5, "update_ratio": None}
        for s in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = open_run(run)
    assert _panel_names(select_panels([loaded])) == [
        "loss",
        "grad_norm_by_kind",
        "attn_entropy",
        "throughput",
    ]
    attn = next(p for p in PANELS if p.name == "attn_entropy")
    assert matching_keys(attn.curves[0], loaded.keys("detail")) == [
        ("attn_entropy/layer.2", "layer 2"),
        ("attn_entropy/layer.10", "layer 10"),
    ]
    assert loaded.series("detail", "attn_entropy/layer.2") == ([1, 2], [3.0, 4.0])
    assert loaded.series("detail", "update_ratio") == ([], [])


def test_events_are_found_and_marked_on_the_loss_panel(runs):
    run = open_run(runs["b"])
    in_file = [
        r for r in read_metrics(runs["b"] / "metrics.jsonl") if r.get("event") not in (None, "checkpoint")
    ]
    assert in_file, "the touchy guard logged no event"
    assert run.events() == in_file
    fig = Figure()
    ax = fig.add_subplot()
    draw_panel(ax, PANELS[0], [run])
    counts: dict[str, int] = {}
    for e in in_file:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["train", "validation", *(f"{k} ({n})" for k, n in sorted(counts.items()))]
    assert len(ax.lines) == 2 + 2 * len(in_file)  # two curves, then a vertical line and a marker per event


def test_plot_writes_a_dashboard_and_one_png_per_panel(runs, tmp_path, capsys):
    code, out, err = run_cli(capsys, "plot", str(runs["a"]), str(runs["b"]), "--out", str(tmp_path / "p"))
    assert code == 0, err
    panels = select_panels([open_run(runs["a"]), open_run(runs["b"])])
    files = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert files == sorted(["dashboard.png", *(f"{p.name}.png" for p in panels)])
    for name in files:
        raw = (tmp_path / "p" / name).read_bytes()
        assert raw[:8] == b"\x89PNG\r\n\x1a\n"
        h, w, _ = imread(tmp_path / "p" / name).shape
        assert h >= 300 and w >= 500
    assert "events marked" in out
    code, out, _ = run_cli(capsys, "plot", str(runs["a"]), "--dashboard-only")  # default: RUN/plots
    assert code == 0 and [p.name for p in (runs["a"] / "plots").iterdir()] == ["dashboard.png"]


@pytest.mark.parametrize("command", ["plot", "compare"])
def test_a_folder_that_is_not_a_run_is_one_line_exit_2(runs, tmp_path, capsys, command):
    code, _, err = run_cli(capsys, command, str(runs["a"]), str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "nope does not exist" in err
    code, _, err = run_cli(capsys, command, str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "no config.toml" in err


# -- compare -------------------------------------------------------------------------------------


def test_compare_lists_exactly_the_keys_the_runs_differ_in(runs, capsys):
    code, out, err = run_cli(capsys, "compare", str(runs["a"]), str(runs["b"]), "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["differences"] == {"optim.lr": [3e-3, 1e-2], "train.steps": [10, 12]}
    code, text, _ = run_cli(capsys, "compare", str(runs["a"]), str(runs["b"]))
    assert text == table_text(result) + "\n"
    diff_lines = text.split("key config differences:\n")[1].splitlines()
    assert [line.split() for line in diff_lines] == [
        ["key", "a", "b"],
        ["optim.lr", "0.003", "0.01"],
        ["train.steps", "10", "12"],
    ]


def test_compare_figures_are_the_summaries(runs):
    result = compare([open_run(runs["a"]), open_run(runs["b"])])
    for name, row in zip("ab", result["runs"], strict=True):
        summary = json.loads((runs[name] / "summary.json").read_text())
        records = read_metrics(runs[name] / "metrics.jsonl")
        evals = [(r["val_loss"], r["step"]) for r in records if "val_loss" in r]
        rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
        assert row["run"] == name and row["status"] == "finished"
        assert row["final_val_loss"] == summary["val_loss"]
        assert (row["best_val_loss"], row["best_val_step"]) == min(evals)
        assert row["steps"] == summary["step"]
        assert row["tokens_seen"] == summary["tokens_seen"]
        assert row["wall_time_s"] == summary["wall_time_s"]
        assert row["parameters"] == summary["parameters"]
        # rel=1e-12: a float64 mean in another order (the note at the top)
        assert row["tokens_per_s"] == pytest.approx(sum(rates) / len(rates), rel=1e-12)


def test_compare_shows_stopped_and_unfinished_runs_from_their_records(runs):
    result = compare([open_run(runs[k]) for k in ("a", "stopped", "killed")])
    a, stopped, killed = result["runs"]
    assert [a["status"], stopped["status"], killed["status"]] == [
        "finished",
        "stopped",
        "running-or-incomplete",
    ]
    records = read_metrics(runs["stopped"] / "metrics.jsonl")
    last = [r for r in records if "tokens_per_s" in r][-1]
    assert stopped["steps"] == 4 and stopped["tokens_seen"] == last["tokens_seen"]
    assert stopped["final_val_loss"] is None and stopped["wall_time_s"] is None  # no evaluation before 10
    assert killed["steps"] == 3  # the cut line is left out
    assert result["differences"] == {}  # the same recipe; stopping early changes no key
    assert differences([{"x": 1, "l": [1, 2]}, {"x": 1, "l": [1, 3], "y": 0}]) == {
        "l": [[1, 2], [1, 3]],
        "y": [None, 0],
    }


def test_a_series_of_few_points_is_drawn_with_markers(tmp_path):
    """A run under 100 steps logs its detail records once (``metrics.detail_interval=50``): a one-point
    series drawn as a bare line is invisible, so it gets a marker; a long series stays a plain line."""
    steps = [
        {"step": s, "loss": 5.0 - s / 100, "tokens_per_s": 10.0, "grad_norm": 1.0 + s} for s in range(40)
    ]
    detail = {"step": 0, "detail": True, "param_norm": 30.0, "attn_entropy/layer.0": 1.5, "attn_entropy": 1.5}
    run = RunRecords(tmp_path / "short", {"step": steps, "eval": [], "detail": [detail], "event": []})
    for name, expected in (("norms", {"gradient": "None", "parameters": "o"}), ("attn_entropy", None)):
        ax = Figure().add_subplot()
        draw_panel(ax, next(p for p in PANELS if p.name == name), [run])
        markers = {line.get_label(): line.get_marker() for line in ax.lines}
        assert markers == (expected or {"layer 0": "o", "mean": "o"})


def test_task_scores_are_a_record_kind_with_their_panel_and_regressions_are_marked(runs, tmp_path):
    """``[eval]``'s records (``task/<name>/<metric>`` and its ``_stderr``) are task records: the tasks
    panel draws one line per score (standard errors left out), and a ``task_regression`` event is marked
    on the loss panel like the guard's."""
    run = tmp_path / "tasks"
    run.mkdir()
    shutil.copyfile(runs["a"] / "config.toml", run / "config.toml")
    records = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 10.0} for s in range(1, 7)]
    records += [
        {"step": s, "task/bisect/acc": a, "task/bisect/acc_stderr": 0.1, "task/gsm.v2/exact_match": a / 2}
        for s, a in ((2, 0.5), (4, 0.6), (6, 0.3))
    ]
    records.append({"event": "task_regression", "step": 6, "task": "bisect", "value": 0.3, "best": 0.6})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = open_run(run)
    assert loaded.series("task", "task/bisect/acc") == ([2, 4, 6], [0.5, 0.6, 0.3])
    assert loaded.events() == [records[-1]] and loaded.last_step == 6
    tasks = next(p for p in PANELS if p.name == "tasks")
    assert tasks in select_panels([loaded])
    assert [(k, label) for _, k, label in panel_keys(tasks, loaded)] == [
        ("task/bisect/acc", "bisect/acc"),
        ("task/gsm.v2/exact_match", "gsm.v2/exact_match"),
    ]
    ax = Figure().add_subplot()
    draw_panel(ax, PANELS[0], [loaded])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train", "task_regression (1)"]
