"""``lmforge plot-schedule`` and ``lmforge lr-find``: the rules, and the commands end to end."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import torch

from lmforge.config import ScheduleConfig
from lmforge.data.loader import PackedLoader, TokenStream
from lmforge.data.prepare import prepare_data
from lmforge.errors import ConfigError
from lmforge.model.loss import NextTokenLoss
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.optim.schedules import Schedule, lr_curve
from lmforge.plan.lr_finder import diverged, smooth, suggest, sweep_lr
from lmforge.precision import PrecisionPolicy
from lmforge.probes.lr_find import range_test
from lmforge.recipe import load_config
from lmforge.report.charts import schedule_chart
from lmforge.train.build import build_model
from lmforge.train.modules import LanguageModelModule
from lmforge.train.step import train_step
from tests.conftest import cli_args, tiny_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], cwd=cwd, capture_output=True, text=True)


def _is_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.01  # not a blank canvas
    return image.shape[:2]


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


def test_plotted_values_are_the_schedule(tmp_path):
    cfg = ScheduleConfig(name="wsd", warmup=10, min_lr_ratio=0.05, wsd={"decay_fraction": 0.3})
    lrs = lr_curve(cfg, 2e-3, 120)
    sched = Schedule(cfg, 120)
    assert lrs == [2e-3 * sched(s) for s in range(120)]
    fig = schedule_chart(lrs, tmp_path / "s.png", "wsd")
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == list(range(120)) and list(line.get_ydata()) == lrs
    _is_png(tmp_path / "s.png")


def test_cli_plot_schedule_writes_png_and_values(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[schedule]\nname = "cosine"\nwarmup = 0.1\n\n[optim]\nlr = 0.01\n')
    r = _cli("plot-schedule", str(recipe), "--train.steps=200", "--out", "plots/lr.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _is_png(tmp_path / "plots" / "lr.png")
    values = json.loads((tmp_path / "plots" / "lr.json").read_text())
    cfg = load_config(recipe, {"train.steps": 200})
    assert values["lr"] == lr_curve(cfg.schedule, 0.01, 200)  # exactly what the schedule gives
    # float64 schedule values (pytest.approx's default: rounding room); the last step's is 0.001 to within
    # the cosine's last step (rel=1e-3), not rounding
    assert values["lr"][19] == pytest.approx(0.01) and values["lr"][-1] == pytest.approx(0.001, rel=1e-3)
    r = _cli("plot-schedule", "--schedule.nme=wsd", cwd=tmp_path)
    assert r.returncode == 2 and "did you mean schedule.name" in r.stderr


def test_lr_finder_rules():  # float64 formulas: pytest.approx's default is rounding room
    assert sweep_lr(0, 50, 1e-6, 1.0) == pytest.approx(1e-6)
    assert sweep_lr(49, 50, 1e-6, 1.0) == pytest.approx(1.0)
    assert sweep_lr(1, 3, 1e-4, 1e-2) == pytest.approx(1e-3)  # geometric midpoint
    assert smooth([5.0] * 7, 0.9) == pytest.approx([5.0] * 7)  # bias correction: no pull towards 0
    s = smooth([4.0, 2.0], 0.5)
    assert s == pytest.approx([4.0, (0.25 * 4 + 0.5 * 2) / 0.75])
    assert diverged(float("nan"), [3.0], 4.0) and diverged(13.0, [3.0, 2.0, 9.0], 4.0)
    assert not diverged(7.0, [3.0, 2.0, 7.0], 4.0)
    # a loss that falls fastest (in log lr) at 1e-3, bottoms out at 1e-1, then rises
    lrs = [sweep_lr(i, 61, 1e-6, 1.0) for i in range(61)]
    loss = [
        5 - 2 / (1 + math.exp(-3 * (math.log10(x) + 3))) + 5 * max(0.0, math.log10(x) + 1) ** 2 for x in lrs
    ]
    got = suggest(lrs, loss)
    # the synthetic curve falls fastest at 1e-3 and the sweep's points are 10^0.1 apart (26%): the rule can
    # land one point off, hence rel=0.3; not rounding
    assert got.lr == pytest.approx(1e-3, rel=0.3)
    # the curve's minimum is at 1e-1 on a grid of 10^0.1 steps: a factor of 2 either side is not rounding
    assert 0.05 < got.min_lr < 0.2 and got.min_over_10 == pytest.approx(got.min_lr / 10)
    with pytest.raises(ValueError, match="three points"):
        suggest(lrs[:2], loss[:2])
    with pytest.raises(ConfigError, match=r"lr_find\.end_lr"):
        load_config(None, {"lr_find.start_lr": 1e-2, "lr_find.end_lr": 1e-3})


@pytest.fixture(scope="module")
def prepared(corpus_dir, tmp_path_factory) -> dict:
    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("lrdata"))
    prepare_data(load_config(None, over).data)
    return over


def test_cli_lr_find_sweeps_suggests_and_leaves_nothing_behind(prepared, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("untouched")
    (work / "runs" / "old" / "step_00000010").mkdir(parents=True)  # an earlier run: must stay as it is
    (work / "runs" / "old" / "step_00000010" / "model.pt").write_bytes(b"weights")
    cache = Path(prepared["data.cache_dir"])
    before_work, before_cache = _tree(work), _tree(cache)
    start, end = 1e-5, 100.0
    over = {**prepared, "lr_find.steps": 40, "lr_find.start_lr": start, "lr_find.end_lr": end}
    r = _cli("lr-find", *cli_args(over), "--out", "sweep", cwd=work)
    assert r.returncode == 0, r.stderr
    assert "suggested lr" in r.stdout
    after = _tree(work)
    assert set(after) - set(before_work) == {"sweep", "sweep/lr_find.json", "sweep/lr_find.png"}
    assert {k: after[k] for k in before_work} == before_work
    assert _tree(cache) == before_cache  # data reused, nothing added (no run folder, no checkpoints)
    _is_png(work / "sweep" / "lr_find.png")
    curve = json.loads((work / "sweep" / "lr_find.json").read_text())
    lr = curve["suggestion"]["lr"]
    assert math.isfinite(lr) and start <= lr <= end
    assert f"--optim.lr={lr:.3g}" in r.stdout
    # pytest.approx's default rel 1e-6 (here and below): float64 values read back from JSON (an exact round
    # trip) against start and against smooth() on the recorded losses: rounding only
    assert curve["lrs"][0] == pytest.approx(start)
    assert curve["stopped_early"]  # lr 100 on a tiny Adam model diverges before the end of the sweep
    assert len(curve["lrs"]) < 40 and curve["stop_lr"] <= end
    assert curve["smoothed"] == pytest.approx(smooth(curve["losses"], 0.9))
    assert min(curve["smoothed"]) < curve["smoothed"][0] - 0.2  # the sweep did train


def test_range_test_puts_model_and_optimizer_back(prepared):
    cfg = load_config(
        None, {**prepared, "lr_find.steps": 12, "lr_find.start_lr": 1e-4, "lr_find.end_lr": 1.0}
    )
    data = prepare_data(cfg.data)
    device = torch.device("cpu")
    model = build_model(cfg, data.tokenizer.vocab_size, device)
    optimizer = build_optimizer(model, cfg.optim, device)
    loader = PackedLoader(TokenStream(data.train), cfg.data.seq_len, cfg.train.micro_batch_size, 0)
    module, fp32 = LanguageModelModule.of(NextTokenLoss(model)), PrecisionPolicy("fp32", device)
    clipper = Clipper("adaptive", 1.0, warmup=2)
    train_step(module, optimizer, [loader.next_batch()], 1e-3, clipper, fp32)  # optimizer has state
    clip_before = copy.deepcopy(clipper.state_dict())
    model_before = copy.deepcopy(model.state_dict())
    optim_before = copy.deepcopy(optimizer.state_dict())
    rng_before = torch.get_rng_state()
    result = range_test(module, optimizer, lambda: [loader.next_batch()], cfg.lr_find, clipper, fp32)
    # pytest.approx's default rel 1e-6: the float64 geometric sweep's last point, 1.0 up to rounding of exp/log
    assert len(result.lrs) == 12 and result.lrs[-1] == pytest.approx(1.0)
    assert len(set(result.losses)) > 1  # it did train
    after = model.state_dict()
    assert all(torch.equal(model_before[k], after[k]) for k in model_before)
    optim_after = optimizer.state_dict()
    assert [g["lr"] for g in optim_after["param_groups"]] == [g["lr"] for g in optim_before["param_groups"]]
    for k, st in optim_before["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(optim_after["state"][k][name])), name
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(p.grad is None for p in model.parameters())
    after_clip = clipper.state_dict()
    assert after_clip["count"] == clip_before["count"] and torch.equal(after_clip["ema"], clip_before["ema"])
