"""An MoE run's routing figures where a user looks at a run: TensorBoard (each expert's load a scalar, the
load a histogram) and ``lmforge plot`` (the imbalance per layer and the balance losses, for MoE runs only),
read back from a real tiny MoE run and a real dense one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.recipe import load_config
from lmforge.report.plots import draw_panel, panel_keys, select_panels, write_dashboard
from lmforge.report.runs import open_run
from lmforge.train.launch import train
from tests.conftest import tiny_overrides


@pytest.fixture(scope="module")
def dense_run(corpus_dir: Path, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dense")
    over = tiny_overrides(corpus_dir, root / "data") | {
        "train.steps": 6,
        "train.log_interval": 1,
        "train.eval_interval": 0,
        "train.checkpoint_interval": 0,
        "train.sample_tokens": 0,
    }
    train(load_config(None, over), root / "dense", progress_bar=False)
    return root / "dense"


def test_tensorboard_has_each_experts_load_and_a_histogram(moe_run: Path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(moe_run / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    run = open_run(moe_run)
    steps = run.records["step"]
    assert len(steps) == 12
    scalars, histograms = set(acc.Tags()["scalars"]), set(acc.Tags()["histograms"])
    for layer in (0, 1):
        key = f"moe/layer.{layer}/load"
        for expert in range(4):
            got = acc.Scalars(f"{key}/expert_{expert}")
            assert [e.step for e in got] == [r["step"] for r in steps]
            # TensorBoard keeps scalars as FP32 (2^-24 = 6e-8 relative) of token counts; 1e-6 is ~16 of those
            assert [e.value for e in got] == pytest.approx([r[key][expert] for r in steps], rel=1e-6)
        assert key in histograms
        hist = acc.Histograms(key)
        assert [h.step for h in hist] == [r["step"] for r in steps]
        last = hist[-1].histogram_value
        # the histogram of the four loads: four entries, their sum and extremes the record's
        # rel=1e-6: the histogram is of an FP32 tensor of the counts: sum and extremes within FP32 rounding
        assert last.num == 4 and last.sum == pytest.approx(sum(steps[-1][key]), rel=1e-6)
        assert (last.min, last.max) == pytest.approx((min(steps[-1][key]), max(steps[-1][key])), rel=1e-6)
    assert {"moe/layer.0/imbalance", "moe/imbalance", "moe/aux_loss", "moe/z_loss"} <= scalars


def test_plot_has_moe_panels_for_an_moe_run_only(moe_run: Path, dense_run: Path, tmp_path: Path):
    moe, dense = open_run(moe_run), open_run(dense_run)
    names = [p.name for p in select_panels([moe])]
    assert "moe_imbalance" in names and "moe_balance_losses" in names
    assert not {"moe_imbalance", "moe_balance_losses"} & {p.name for p in select_panels([dense])}

    panel = next(p for p in select_panels([moe]) if p.name == "moe_imbalance")
    lines = [(key, label) for _, key, label in panel_keys(panel, moe)]
    assert lines == [
        ("moe/layer.0/imbalance", "layer 0"),
        ("moe/layer.1/imbalance", "layer 1"),
        ("moe/imbalance", "worst"),
    ]
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    draw_panel(ax, panel, [moe])
    drawn = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    steps = moe.records["step"]
    for i in (0, 1):  # max / mean of the logged loads, computed here from the lists
        load = [r[f"moe/layer.{i}/load"] for r in steps]
        # rel=1e-6: the logged imbalance is float64 max / mean of the same integer counts (~1e-16): room
        assert drawn[f"layer {i}"] == pytest.approx([max(x) / (sum(x) / len(x)) for x in load], rel=1e-6)
    losses = next(p for p in select_panels([moe]) if p.name == "moe_balance_losses")
    assert [label for _, _, label in panel_keys(losses, moe)] == ["aux (Switch)", "router z-loss"]

    written = write_dashboard([moe, dense], tmp_path / "plots")
    assert tmp_path / "plots" / "moe_imbalance.png" in written
    assert tmp_path / "plots" / "moe_balance_losses.png" in written
    assert not (tmp_path / "dense_only" / "moe_imbalance.png").exists()
    assert "moe_imbalance.png" not in {p.name for p in write_dashboard([dense], tmp_path / "dense_only")}
