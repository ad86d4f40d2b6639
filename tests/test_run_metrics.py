"""The run-level keys of the step record (callbacks/metrics.py): skipped steps, memory, MFU, the share of
time spent waiting for data, the gradient noise scale; and the GPU peak lookup behind MFU."""

from __future__ import annotations

import json
import logging
import math
import re
import resource

import pytest
import torch

from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.plan import hardware
from lmforge.plan.flops import flops_per_token
from lmforge.probes.peak_flops import cpu_peak_flops
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.metrics import StepMetrics, memory_record
from lmforge.train.launch import train
from lmforge.train.step import Action
from lmforge.train.trainer import Trainer
from tests.conftest import tiny_overrides


def _config(corpus_dir, tmp_path, **over):
    base = tiny_overrides(corpus_dir, tmp_path / "data")
    base.update(
        {"train.steps": 6, "train.log_interval": 3, "train.eval_interval": 0, "train.sample_tokens": 0}
    )
    base.update({"train.checkpoint_interval": 0, "train.eval_tokens": 256})
    return load_config(None, {**base, **over})


class VetoAttempt(Callback):
    """Vetoes (skips) the step attempt numbered ``attempt`` (from 0 in this process)."""

    def __init__(self, attempt: int):
        self.attempt = attempt

    def veto(self, trainer, loss, grad_norm):
        return Action.SKIP if trainer.attempt == self.attempt else Action.STEP


def _step_records(run_dir) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "tokens_per_s" in x]


def test_step_record_run_keys(corpus_dir, tmp_path, caplog):
    cfg = _config(corpus_dir, tmp_path, **{"train.tokens_per_step": 2 * 4 * 32})  # two micro-batches
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="lmforge"):
        train(cfg, run_dir, progress_bar=False, callbacks=[VetoAttempt(1)])
    # the peak MFU divides by, logged with three significant digits (a CPU's is a few hundredths of a
    # TFLOP/s, once logged as "0.0"): half a unit of the third digit is 0.5% at most
    (logged,) = re.findall(r"mfu: against .* = (\S+) TFLOP/s per device", caplog.text)
    # rel=5e-3: the three-digit log, see above
    assert float(logged) == pytest.approx(cpu_peak_flops() / 1e12, rel=5e-3)
    records = _step_records(run_dir)
    assert [r["step"] for r in records] == [3, 6]
    assert [r["skipped_steps"] for r in records] == [1, 1]  # cumulative: the vetoed second attempt
    with torch.device("meta"):  # parameter count only; the tiny corpus fills the 512-token vocabulary
        model = Transformer(cfg.model, 512, cfg.data.seq_len)
    fpt = flops_per_token(model.num_params(), cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len)
    for r in records:
        assert r["batch_tokens"] == 256
        assert 0.0 <= r["data_wait_share"] <= 1.0
        assert r["data_wait_share"] > 0  # reading batches takes some time
        assert 0 < r["mem_rss_gib"] < 64
        assert "mem_peak_allocated_gib" not in r  # CUDA only
        # measured once per process; the record holds it in TFLOP/s: float64 rounding (1.1e-16 measured)
        assert r["peak_tflops"] * 1e12 == pytest.approx(cpu_peak_flops())
        assert 0 < r["mfu"] < 1
        # the formula on the logged figures, float64 both sides: 1.4e-16 measured
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (r["peak_tflops"] * 1e12), rel=1e-9)
        _check_noise_scale(r)


def _check_noise_scale(r: dict) -> None:
    """The smoothed noise trace is positive (small batches: noise dominates); ``|G|^2``'s estimate may come
    out negative this early, and then the ratio is NaN (``null`` in the file)."""
    assert r["gns_noise_trace"] > 0 and math.isfinite(r["gns_grad_sq"])
    if r["gns_grad_sq"] > 0:
        assert r["gns_critical_batch"] == pytest.approx(r["gns_noise_trace"] / r["gns_grad_sq"])  # float64
    else:
        assert r["gns_critical_batch"] is None


def test_no_noise_scale_with_one_micro_batch(corpus_dir, tmp_path):
    cfg = _config(corpus_dir, tmp_path, **{"train.steps": 3})
    train(cfg, tmp_path / "run", progress_bar=False)
    (record,) = _step_records(tmp_path / "run")
    assert "gns_critical_batch" not in record and record["skipped_steps"] == 0


class Recorder(Callback):
    """Keeps the initial parameters and the micro-batches of the (single) step."""

    def on_train_start(self, trainer):
        self.initial = {k: v.detach().clone() for k, v in trainer.run.model.state_dict().items()}

    def on_batches(self, trainer, batches):
        self.batches = batches
        return batches


def _grad_sq(run, initial, batches) -> float:
    """``|mean-per-token gradient|^2`` of ``batches`` together, at ``initial``."""
    run.model.load_state_dict(initial)
    run.model.zero_grad(set_to_none=True)
    objective = NextTokenLoss(run.model, run.cfg.train.loss_chunk)
    loss_sum = sum(objective(b.inputs, b.targets, b.doc_ids)[0] for b in batches)
    (loss_sum / sum(b.n_targets for b in batches)).backward()
    return float(sum(p.grad.double().square().sum() for p in run.model.parameters() if p.grad is not None))


def test_noise_scale_reads_the_first_micro_batch_gradient(corpus_dir, tmp_path):
    """After one step the two moving averages give back the two squared norms the step fed them: the
    first micro-batch's mean-per-token gradient (rescaled from the step's normalisation) and the step's,
    both recomputed here from the same batches and initial weights."""
    cfg = _config(corpus_dir, tmp_path, **{"train.steps": 1, "train.tokens_per_step": 3 * 4 * 32})
    torch.manual_seed(0)
    run = build_run(cfg)
    metrics, recorder = StepMetrics(), Recorder()
    Trainer(run, [metrics, recorder]).fit()
    gns = metrics._gns
    assert gns is not None and gns.count == 1
    n_small = recorder.batches[0].n_targets
    n_big = sum(b.n_targets for b in recorder.batches)
    w = 1 - gns.beta  # one update: each average is w times the step's estimate
    sq_small = (float(gns.grad_sq) + float(gns.trace) / n_small) / w  # E|G_B|^2 = |G|^2 + S / B
    sq_big = (float(gns.grad_sq) + float(gns.trace) / n_big) / w
    # FP32 squared gradient norms, the step's and a recomputation's (other accumulation order, the averages'
    # FP32 arithmetic): measured 6e-8 and 3.9e-7 relative; 1e-4 is room for the averages' cancellation
    # (|G|^2 + S / B from two estimates of different size)
    assert sq_small == pytest.approx(_grad_sq(run, recorder.initial, recorder.batches[:1]), rel=1e-4)
    # rel=1e-4: as above
    assert sq_big == pytest.approx(_grad_sq(run, recorder.initial, recorder.batches), rel=1e-4)
    assert sq_small > sq_big  # a third of the batch is noisier


def test_memory_record_on_cpu_is_the_resident_size():
    rss = memory_record(torch.device("cpu"))["mem_rss_gib"] * 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    # 1%: room for two reads of the kernel's resident-memory counters at different moments; no measured figure
    assert 0 < rss <= peak * 1.01


@pytest.mark.parametrize(
    ("name", "memory", "expected"),
    [
        ("NVIDIA H200", None, "h200"),
        ("NVIDIA H100 80GB HBM3", None, "h100-80gb"),
        ("NVIDIA A100-SXM4-80GB", None, "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", None, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", None, "a100-40gb"),
        ("NVIDIA A100-SXM4", 40 * 2**30, "a100-40gb"),
        ("NVIDIA H100 PCIe", None, None),  # lower peaks than the table's SXM figures
        ("NVIDIA H200 NVL", None, None),
        ("NVIDIA GeForce RTX 4090", None, None),
    ],
)
def test_gpu_peak_from_device_name(name, memory, expected):
    hw = hardware.from_device_name(name, memory)
    assert (hw.name if hw is not None else None) == expected
    if expected == "h200":
        assert hw.peak("bf16") == pytest.approx(989.4e12)  # a table's float64 figure: rounding only
