"""The per-step metrics record (:class:`StepMetrics`; its sinks: ``callbacks/sinks.py``) and the gradient
noise scale it carries (the formulas and their moving averages: ``optim/noise_scale.py``; the unit of
``gns_critical_batch`` is target tokens)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import ModelConfig
from lmforge.data.loader import Batch
from lmforge.optim.noise_scale import NoiseScale, critical_batch, first_micro_batch_sq
from lmforge.plan.flops import mfu, model_flops_per_token
from lmforge.probes.peak_flops import Peak, device_peak
from lmforge.train.build import Run
from lmforge.train.callbacks import Callback
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def eta_seconds(remaining: int, step_s: float, overhead_s: float, done: int) -> float:
    """Seconds left: ``remaining * (step_s + overhead_s / done)``.

    ``step_s`` is the smoothed time of one training step (batches, forward, backward, optimizer) and
    ``overhead_s`` the time spent outside steps (evaluations, checkpoints) over the ``done`` steps of this
    process so far, spread evenly: the estimate does not jump after an evaluation or a checkpoint."""
    return remaining * (step_s + overhead_s / max(done, 1))


GIB = 2**30
# step-record keys a rerun or a resume does not reproduce: measured from the clock or the host, and the
# noise scale (its averages restart with each process)
MEASURED_KEYS = (
    "tokens_per_s", "eta_s", "data_wait_share", "mfu", "peak_tflops",
    "mem_rss_gib", "mem_peak_allocated_gib", "mem_reserved_gib",
    "gns_critical_batch", "gns_noise_trace", "gns_grad_sq",
)  # fmt: skip


def process_rss_bytes() -> int | None:
    """Resident memory of this process (``/proc/self/statm``'s second field times the page size); None
    where there is no ``/proc`` (not Linux)."""
    try:
        resident = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")


def noise_scale_blocker(run: Run) -> str | None:
    """Why the gradient noise scale cannot be measured in ``run`` (None: it can). It needs two batch sizes
    (at least two micro-batches a step) and the first micro-batch's gradient whole on this rank: true for
    one process and for DDP / ZeRO-1 (no synchronisation before the last micro-batch); FSDP2
    reduce-scatters every micro-batch and shards it, a pipeline stage or a tensor-parallel shard holds
    only part of it, and expert-parallel experts hold the rows of all ranks."""
    if run.accum < 2:  # the full batch (a batch schedule's smaller steps of one micro-batch are skipped)
        return "one micro-batch per step (raise train.tokens_per_step for two batch sizes)"
    if run.layout.kind == "fsdp":
        return "FSDP2 reduces and shards the gradient of every micro-batch"
    if run.layout.degrees["pp"] > 1 or run.layout.degrees["tp"] > 1:
        return "pipeline stages and tensor-parallel shards hold only part of the gradient"
    if run.layout.ep > 1:
        return "expert-parallel experts receive every rank's rows, so their gradient is not this rank's"
    return None


def computed_work(batches: list[Batch], model: ModelConfig, vocab_size: int) -> tuple[int, float]:
    """``(positions, model FLOPs)`` of ``batches`` as they run through the model: every position of every
    row, padding included, at ``flops_per_token`` of the rows' own width (its attention term ``12 L d T``
    with ``T`` = the width)."""
    positions, flops = 0, 0.0
    for batch in batches:
        n = batch.inputs.numel()
        positions += n
        flops += n * model_flops_per_token(model, vocab_size, batch.inputs.shape[-1])
    return positions, flops


class StepMetrics(Callback):
    """Every ``train.log_interval`` steps (and the last): loss, lr, gradient norm before clipping, clip
    ratio and threshold, clipped steps since the previous line, skipped steps so far, the loss scale
    (fp16), tokens/s of the training steps over that window, model FLOPs utilisation, the share of that
    time spent waiting for batches, memory, the gradient noise scale, the ETA (:func:`eta_seconds`),
    tokens seen, epoch, and the loader's report (phase and mix of a mixture). Every key:
    ``docs/metrics.md``.

    Timing: the first step of a process (compilation, warm caches) is kept apart, as long as later steps
    exist to measure; evaluations and checkpoints are not training time: they enter the ETA spread over
    the steps done, so the ETA does not jump after them.

    MFU: ``tokens_per_s * flops_per_token / (peak * world)`` (``plan/flops.py``), the peak of one device
    in the run's precision (``probes/peak_flops.py``: the data sheet of a known GPU, a measured float32
    matmul on a CPU), logged once at the start; an unknown GPU gets no ``mfu``.

    Gradient noise scale (:class:`NoiseScale`, module docstring): with two or more micro-batches a step, the squared
    norm of the gradient after the first micro-batch (one fused norm per step on the device, no host
    sync) and of the step's gradient feed the moving averages every step; the ratio is read only when a
    record is written. Layouts where the first micro-batch's gradient is not whole on the rank are
    skipped with a logged reason (:func:`noise_scale_blocker`)."""

    SMOOTHING = 0.3  # weight of the newest window in the step-time average
    state_key = "step_metrics"

    def __init__(self) -> None:
        self.skipped = 0  # vetoed or overflowed attempts over the whole run (kept in checkpoints)
        self._reset()

    def _reset(self) -> None:
        self._window_s = 0.0  # training-step time in the current window
        self._window_data_s = 0.0  # of which waiting for batches
        self._window_steps = 0
        self._clipped: torch.Tensor | int = 0
        self._start = 0.0
        self._steps = 0  # steps done by this process
        self._train_s = 0.0  # training-step time of this process, first step apart
        self._first_s = 0.0  # the first step of this process
        self._first_data_s = 0.0
        self._step_s: float | None = None  # smoothed seconds per step
        self._flops_per_token = 0.0
        self._peak: Peak | None = None
        self._world = 1
        self._gns: NoiseScale | None = None
        self._small: tuple[int, int, torch.Tensor] | None = None  # this step's B_small, B_big, |G_small|^2
        # DPO (rows padded to each batch's longest pair): this rank's (positions, FLOPs) of the attempt's
        # batches, of the first step and of the window; other objectives' rows are all data.seq_len long
        self._padded = False
        self._batches_work: tuple[int, float] = (0, 0.0)
        self._first_work: tuple[int, float] = (0, 0.0)
        self._window_work: tuple[int, float] = (0, 0.0)
        self._first_tokens = 0  # the others': tokens of the first step and of the window's steps
        self._window_tokens = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self._reset()
        run = trainer.run
        self._flops_per_token = model_flops_per_token(
            run.cfg.model, run.data.tokenizer.vocab_size, run.cfg.data.seq_len
        )
        self._world = run.layout.world
        self._padded = run.cfg.train.objective in ("dpo", "reward")
        self._peak = device_peak(run.device, run.precision.name)
        main = run.layout.is_main
        if self._peak is None:
            if main:
                log.info(
                    "mfu: no peak FLOP/s known for %s in %s; no mfu logged", run.device, run.precision.name
                )
        elif main:
            log.info(
                "mfu: against %s = %.3g TFLOP/s per device x %d; %.4g FLOP per token (6N + 12 L d T, N the "
                "parameters a token uses)",
                self._peak.source,
                self._peak.flops / 1e12,
                self._world,
                self._flops_per_token,
            )
        blocker = noise_scale_blocker(run)
        if blocker is None:
            self._gns = NoiseScale()
        elif main:
            log.info("gradient noise scale: not measured: %s", blocker)
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.device)
        self._start = time.perf_counter()

    def on_batches(self, trainer: Trainer, batches: list[Batch]) -> list[Batch]:
        if self._padded:
            run = trainer.run
            self._batches_work = computed_work(batches, run.cfg.model, run.data.tokenizer.vocab_size)
        return batches

    def _work(self, run: Run) -> tuple[float, float]:
        """``(positions, FLOPs)`` of every data-parallel rank over the timed steps (the window's, else the
        first step's): DPO's as computed (summed over the data-parallel group: each rank pads its own
        pairs), the others' ``tokens_per_step`` positions a step."""
        if not self._padded:  # the tokens of each step (a batch schedule changes them)
            tokens = self._window_tokens if self._window_steps else self._first_tokens
            return tokens, tokens * self._flops_per_token
        local = self._window_work if self._window_steps else self._first_work
        if run.layout.dp == 1:
            return local
        total = torch.tensor(local, dtype=torch.float64, device=run.device)
        dist.all_reduce(total, group=run.layout.group("dp"))
        return float(total[0]), float(total[1])

    def after_micro_batch(self, trainer: Trainer, index: int, n_targets: int, step_targets: int) -> None:
        if self._gns is None or index != 0:
            return
        run = trainer.run
        sq = first_micro_batch_sq(
            run.model.parameters(), n_targets, step_targets, run.layout.dp, run.precision.loss_scale
        )
        if sq is not None:
            self._small = (n_targets, step_targets, sq)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        small, self._small = self._small, None
        dt, data_dt = trainer.step_time_s, trainer.data_time_s
        if result.action is Action.STEP and self._steps == 0:
            self._first_s, self._first_data_s = dt, data_dt
        else:
            self._window_s += dt
            self._window_data_s += data_dt
            self._train_s += dt
        if result.action is not Action.STEP:
            self.skipped += 1
            return
        run = trainer.run
        if self._gns is not None and small is not None and small[1] > small[0] > 0:
            b_small, b_big, sq_small = small
            self._gns.update(b_small, sq_small, b_big, result.grad_norm.float().square())
        self._steps += 1
        self._window_steps += self._steps > 1
        if self._steps == 1:
            self._first_work, self._first_tokens = self._batches_work, trainer.step_tokens
        else:
            self._window_tokens += trainer.step_tokens
            self._window_work = tuple(
                a + b for a, b in zip(self._window_work, self._batches_work, strict=True)
            )
        self._clipped = self._clipped + (result.clip.ratio < 1)  # stays on the device until logged
        step = trainer.progress.step
        if step % run.cfg.train.log_interval and step != trainer.total_steps:
            return
        if self._window_steps:
            per_step, data_s = self._window_s / self._window_steps, self._window_data_s / self._window_steps
        else:  # only the first step so far: it is all there is to go by
            per_step, data_s = self._first_s, self._first_data_s
        a = self.SMOOTHING
        self._step_s = per_step if self._step_s is None else a * per_step + (1 - a) * self._step_s
        overhead = time.perf_counter() - self._start - self._train_s - self._first_s
        positions, flops = self._work(run)
        steps = self._window_steps or 1
        tokens_per_s = positions / (per_step * steps) if per_step > 0 else 0.0
        record = {
            "step": step,
            "loss": float(result.loss),
            "lr": trainer.lr,
            "grad_norm": float(result.grad_norm),
            "clip_ratio": float(result.clip.ratio),
            "clipped_steps": int(self._clipped),
            "skipped_steps": self.skipped,
            "tokens_per_s": tokens_per_s,
            "data_wait_share": data_s / per_step if per_step > 0 else 0.0,
            "batch_tokens": round(positions / steps),
            "eta_s": eta_seconds(trainer.total_steps - step, self._step_s, max(overhead, 0.0), self._steps),
            "tokens_seen": trainer.progress.tokens_seen,
            "epoch": run.loader.epoch,
            **run.loader.report(),
            **run.module.take_metrics(),
        }
        if self._peak is not None:
            per_token = flops / positions if positions else self._flops_per_token
            record["mfu"] = mfu(tokens_per_s, per_token, self._peak.flops * self._world)
            record["peak_tflops"] = self._peak.flops / 1e12
        if self._gns is not None and self._gns.count:
            trace, grad_sq = self._gns.smoothed()
            record["gns_critical_batch"] = critical_batch(trace, grad_sq)
            record["gns_noise_trace"], record["gns_grad_sq"] = trace, grad_sq
        record.update(memory_record(run.device))
        if run.comm is not None:  # DDP: bytes this rank handed to the gradient all-reduce, per step
            record["comm_bytes_per_step"] = run.comm.take_bytes_per_step()
        if result.clip.threshold is not None:
            record["clip_threshold"] = float(result.clip.threshold)
        if run.precision.scaler is not None:  # fp16: the scale the next step uses
            record["loss_scale"] = run.precision.loss_scale
        trainer.log(record)
        self._window_s, self._window_data_s, self._window_steps, self._clipped = 0.0, 0.0, 0, 0
        self._window_work, self._window_tokens = (0, 0.0), 0

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = state.get("skipped_steps", 0)


def memory_record(device: torch.device) -> dict:
    """On CUDA the peak allocated since the previous call (the peak is reset) and the reserved memory; on a
    CPU the process's resident memory; in GiB."""
    if device.type == "cuda":
        out = {
            "mem_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    rss = process_rss_bytes()
    return {} if rss is None else {"mem_rss_gib": rss / GIB}
