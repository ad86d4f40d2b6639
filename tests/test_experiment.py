"""``lmforge experiment``: a 2-arm, 2-seed, 5-step toy through the command (folder layout, interleaved
order, resume), its statistics against hand computations and tabulated t values, and the refusals."""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
from pathlib import Path

import pytest
from scipy import stats as scipy_stats

from lmforge.experiment.results import steps_to_reach
from lmforge.experiment.stats import betainc, one_sample_test, t_two_sided_p, welch_test

ARMS = ("optim.lr=0.003", "optim.lr=0.01")
SEEDS = (1337, 1338)


def toy_recipe(corpus_dir: Path, root: Path) -> Path:
    """The tests' tiny model on the tiny corpus: 5 steps, evaluated at 2, 4 and 5, checkpoints at 4 and 5."""
    recipe = root / "toy.toml"
    recipe.write_text(
        f"""[data]
sources = [{{path = "{corpus_dir / "stdlib.jsonl"}"}}]
cache_dir = "{root / "data"}"
vocab_size = 512
seq_len = 32
val_fraction = 0.1
[model]
n_layers = 2
d_model = 32
n_heads = 4
[schedule]
warmup = 1
[train]
steps = 5
micro_batch_size = 4
precision = "fp32"
compile = false
eval_interval = 2
eval_tokens = 256
checkpoint_interval = 4
keep_checkpoints = 3
log_interval = 1
sample_tokens = 0
"""
    )
    return recipe


def experiment(recipe: Path, out: Path, *flags: str) -> list[str]:
    return [
        "experiment",
        str(recipe),
        "--seeds",
        "2",
        "--vary",
        "optim.lr=0.003,0.01",
        "--out",
        str(out),
        *flags,
    ]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from lmforge.cli import main

    with pytest.raises(SystemExit) as done:
        main(args)
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.fixture(scope="module")
def toy(corpus_dir, tmp_path_factory):
    """The toy experiment, run once through the command: ``(recipe, experiment folder, stdout)``."""
    import logging

    from lmforge.cli import main

    root = tmp_path_factory.mktemp("experiment")
    recipe = toy_recipe(corpus_dir, root)
    logger = logging.getLogger("lmforge")
    handlers, level = logger.handlers[:], logger.level
    try:
        with pytest.raises(SystemExit) as done:
            main(experiment(recipe, root / "exp"))
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    assert done.value.code == 0
    return recipe, root / "exp"


def summaries(out: Path) -> dict[tuple[str, int], Path]:
    return {(arm, seed): out / arm / f"seed_{seed}" / "summary.json" for seed in SEEDS for arm in ARMS}


def test_folder_layout(toy):
    _, out = toy
    assert {p.name for p in out.iterdir()} == {
        "experiment.json", "results.json", "results.md", "experiment.png", *ARMS
    }  # fmt: skip
    for path in summaries(out).values():
        run = path.parent
        assert path.is_file() and (run / "metrics.jsonl").is_file() and (run / "config.toml").is_file()
    assert (out / "experiment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each run is an ordinary run with its arm's value and its seed
    cfg = (out / "optim.lr=0.01" / "seed_1338" / "config.toml").read_text()
    assert "lr = 0.01\n" in cfg and "seed = 1338\n" in cfg
    md = (out / "results.md").read_text()
    for metric in ("val_loss", "steps_to_target", "tokens_to_target", "wall_time"):
        assert f"## {metric}:" in md


def test_runs_are_interleaved(toy):
    """Seed 1 of every arm, then seed 2: the order the runs finished in."""
    _, out = toy
    paths = summaries(out)
    finished = sorted(paths, key=lambda k: paths[k].stat().st_mtime_ns)
    assert finished == [(arm, seed) for seed in SEEDS for arm in ARMS]


def test_statistics_match_a_hand_computation(toy):
    _, out = toy
    res = json.loads((out / "results.json").read_text())
    finals = {
        arm: [json.loads((out / arm / f"seed_{s}" / "summary.json").read_text())["val_loss"] for s in SEEDS]
        for arm in ARMS
    }  # every run trained the same tokens: the loss at equal tokens is the final loss
    a, b = finals[ARMS[0]], finals[ARMS[1]]
    rows = res["metrics"]["val_loss"]["arms"]
    # float64: fsum mean of 2 losses vs statistics' exact mean: <= 1 ulp (2e-16); rel 1e-12 is margin
    assert rows[ARMS[0]]["mean"] == pytest.approx(statistics.mean(a), rel=1e-12)
    # x - mean cancels to the seed spread: error ~2.2e-16 x loss / spread in float64, under 1e-9 for spreads > ~1e-6
    assert rows[ARMS[0]]["sd"] == pytest.approx(statistics.stdev(a), rel=1e-9)
    assert rows[ARMS[1]]["n"] == 2
    va, vb = statistics.variance(a) / 2, statistics.variance(b) / 2
    row = rows[ARMS[1]]
    # diff, t, df: the same cancellation (means ~1 ulp each, difference at the arms' spread); p: our continued
    # fraction vs scipy's on those t and df (rel 1e-8: 10x the t bound, the p slope at df ~1 amplifies little)
    assert row["diff"] == pytest.approx(statistics.mean(b) - statistics.mean(a), rel=1e-9)
    assert row["t"] == pytest.approx((statistics.mean(b) - statistics.mean(a)) / math.sqrt(va + vb), rel=1e-9)
    assert row["df"] == pytest.approx((va + vb) ** 2 / (va**2 + vb**2), rel=1e-9)  # n - 1 = 1
    assert row["p"] == pytest.approx(scipy_stats.ttest_ind(b, a, equal_var=False).pvalue, rel=1e-8)
    # the target defaults to the baseline arm's mean final loss
    # the same fsum mean of 2 float64 losses: <= 1 ulp; rel 1e-12 is margin
    assert res["target"] == pytest.approx(statistics.mean(a), rel=1e-12)
    assert res["equal_tokens"] == 5 * 4 * 32


def test_resume_skips_finished_runs_and_continues_a_killed_one(toy, capsys, cli_logging):
    recipe, out = toy
    paths = summaries(out)
    before = {k: p.stat().st_mtime_ns for k, p in paths.items()}
    code, stdout, _ = run_cli(experiment(recipe, out), capsys)
    assert code == 0 and "0 runs trained, 4 finished before" in stdout
    assert {k: p.stat().st_mtime_ns for k, p in paths.items()} == before
    # arm 2, seed 2 killed after its step-4 checkpoint (its step-5 one gone); arm 1, seed 2 before its first
    killed = paths[(ARMS[1], SEEDS[1])].parent
    (killed / "summary.json").unlink()
    shutil.rmtree(killed / "checkpoints" / "step_00000005")
    kept = (killed / "checkpoints" / "step_00000004").stat().st_mtime_ns
    fresh = paths[(ARMS[0], SEEDS[1])].parent
    shutil.rmtree(fresh / "checkpoints")
    (fresh / "summary.json").unlink()
    code, stdout, _ = run_cli(experiment(recipe, out), capsys)
    assert code == 0 and "2 runs trained, 2 finished before" in stdout
    assert (killed / "checkpoints" / "step_00000004").stat().st_mtime_ns == kept  # continued, not redone
    assert (killed / "summary.json").is_file() and (fresh / "summary.json").is_file()
    for key in [(ARMS[0], SEEDS[0]), (ARMS[1], SEEDS[0])]:
        assert paths[key].stat().st_mtime_ns == before[key]


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--vary", "optim.nope=1,2"], "--vary optim.nope: unknown config key"),
        (["--vary", "optim.name=adamw,sgdx"], "optim.name"),
        (["--vary", "train.seed=1,2"], "--vary train.seed"),
        (["--seeds", "1"], "--seeds 1: at least 2"),
        (["--metric", "speed"], "--metric speed: unknown metric"),
        (["--vary", "optim.lr"], "--vary optim.lr: write KEY=A,B"),
    ],
)
def test_bad_input_is_one_line_before_any_run(corpus_dir, tmp_path, capsys, cli_logging, flags, names):
    recipe = toy_recipe(corpus_dir, tmp_path)
    args = ["experiment", str(recipe), "--seeds", "2", "--out", str(tmp_path / "exp"), *flags]
    if "--vary" not in flags:
        args += ["--vary", "optim.lr=0.003,0.01"]
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and names in err, err
    assert not (tmp_path / "exp").exists() and not (tmp_path / "data").exists()


def test_a_folder_of_another_experiment_is_refused(toy, capsys, cli_logging):
    recipe, out = toy
    code, _, err = run_cli(experiment(recipe, out, "--train.steps=6"), capsys)
    assert code == 2 and "holds another experiment" in err and len(err.strip().splitlines()) == 1


def test_welch_by_hand():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 9.0]
    # means 5/2 and 21/4; variances 5/3 and 107/12; squared standard errors 5/12 and 107/48
    va, vb = 5 / 12, 107 / 48
    w = welch_test(a, b)
    # fsum means of small integers are exact: the difference 11/4 is exact, 1e-15 is a few ulps of room;
    # t and df: a handful of float64 operations (0.5 ulp each): ~1e-15, rel 1e-14 is margin;
    # p: our continued fraction (stops at steps of 1e-15) vs scipy's, both float64 through exp(lgamma): ~1e-14
    assert w.diff == pytest.approx(21 / 4 - 5 / 2, rel=1e-15)
    assert w.t == pytest.approx((21 / 4 - 5 / 2) / math.sqrt(va + vb), rel=1e-14)
    assert w.df == pytest.approx((va + vb) ** 2 / (va**2 / 3 + vb**2 / 3), rel=1e-14)
    assert w.p == pytest.approx(scipy_stats.ttest_ind(b, a, equal_var=False).pvalue, rel=1e-10)
    assert welch_test([1.0], b).p is None and welch_test([1.0, 1.0], [2.0, 2.0]).p is None


def test_one_sample_by_hand():
    # [1, 2, 3] against 0: mean 2, s = 1, t = 2 sqrt(3); at 2 df the t CDF is 1/2 + t / (2 sqrt(t^2 + 2)),
    # so p = 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14)
    r = one_sample_test([1.0, 2.0, 3.0])
    assert (r.diff, r.df) == (2.0, 2.0)
    # t = 2 / (1 / sqrt 3) in a few float64 operations: ~1e-15; p = 1 - 0.926 cancels 13x over the continued
    # fraction's 1e-15 stop: ~1e-14, rel 1e-10 is margin
    assert r.t == pytest.approx(2 * math.sqrt(3), rel=1e-14)
    assert r.p == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-10)
    shifted = one_sample_test([1.5, 2.5, 3.5], mu=0.5)  # the same test moved by mu
    # shifting by 0.5 is exact in binary: the same t and p up to the rounding of mean - mu (~1e-16)
    assert shifted.t == pytest.approx(r.t, rel=1e-14) and shifted.p == pytest.approx(r.p, rel=1e-12)
    assert one_sample_test([1.0]).p is None and one_sample_test([2.0, 2.0]).p is None


@pytest.mark.parametrize(
    ("t", "df", "p"),
    # two-sided critical values of Student's t (printed t tables, 3 decimals)
    [(12.706, 1, 0.05), (4.303, 2, 0.05), (4.032, 5, 0.01), (2.228, 10, 0.05), (1.697, 30, 0.10),
     (2.660, 60, 0.01), (3.291, 1e6, 0.001)],
)  # fmt: skip
def test_t_distribution_against_tables(t, df, p):
    # tables print t to 3 decimals: t +- 5e-4 moves p by 2 pdf(t) 5e-4, up to 1.8e-3 of p at (3.291, 1e6)
    assert t_two_sided_p(t, df) == pytest.approx(p, rel=2e-3)
    assert t_two_sided_p(-t, df) == t_two_sided_p(t, df)


def test_t_distribution_against_scipy_at_fractional_df():
    rng = random.Random(0)
    # float64 both: lgamma terms up to ~80 at df 60 carry ~1e-14 through exp; 1e-9 is margin for the two stopping
    # rules, abs 1e-15 for p near 0. betainc: the exact decimal 0.5248, abs=1e-12 is float64 rounding room
    for _ in range(300):
        t, df = rng.uniform(-8, 8), rng.uniform(1.0, 60.0)
        assert t_two_sided_p(t, df) == pytest.approx(2 * scipy_stats.t.sf(abs(t), df), rel=1e-9, abs=1e-15)
    assert betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-12)  # 1 - sum_{j<2} C(4,j) .4^j .6^(4-j)


def test_steps_to_target_interpolates_between_evaluations():
    curve = [(2, 6.0), (4, 5.0), (6, 4.0)]
    assert steps_to_reach(curve, 5.5) == 3.0
    assert steps_to_reach(curve, 6.5) == 2.0
    assert steps_to_reach(curve, 3.0) is None


def test_chart_draws_each_arms_mean_and_spread(tmp_path):
    from lmforge.report.charts import experiment_chart

    curves = {
        "a": [[(2, 6.0), (4, 5.0)], [(2, 6.2), (4, 5.4)]],
        "b": [[(2, 6.1), (4, 4.0)], [(2, 5.9), (4, 4.2)]],
    }
    fig = experiment_chart(curves, {"a": [5.0, 5.4], "b": [4.0, 4.2]}, tmp_path / "e.png", "toy")
    left, right = fig.axes
    means = {line.get_label(): list(line.get_ydata()) for line in left.get_lines()}
    # pytest.approx's default rel 1e-6 here and below: float64 means and sd of one-decimal numbers vs hand decimals
    assert means["a (n=2)"] == pytest.approx([6.1, 5.2]) and means["b (n=2)"] == pytest.approx([6.0, 4.1])
    band = left.collections[0].get_paths()[0].vertices[:, 1]  # mean +- sd; lowest at step 4
    assert min(band) == pytest.approx(5.2 - statistics.stdev([5.0, 5.4]))
    bars = list(right.containers)  # one error bar per arm: the mean of its final losses
    assert [float(b.lines[0].get_ydata()[0]) for b in bars] == pytest.approx([5.2, 4.1])
    assert (tmp_path / "e.png").stat().st_size > 0
