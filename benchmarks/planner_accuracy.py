"""The memory planner against one real training step, case by case: the accuracy matrix.

    python benchmarks/planner_accuracy.py                 # every case; writes both files below
    python benchmarks/planner_accuracy.py --quick         # a few cases, prints the table only
    python benchmarks/planner_accuracy.py --cases ddp-fp32-adamw,zero3-fp32-adamw-gqa [--write]
    python benchmarks/planner_accuracy.py --render        # only the doc again, from the JSON file
    python benchmarks/planner_accuracy.py --device cuda   # the one-process cases on this machine's GPU

Each case is a tiny recipe (``--SECTION.KEY=VALUE`` overrides over :data:`BASE`) and a process count. It
is built by ``train/build.py::build_run`` in a worker (one process, or ``torchrun --standalone`` with gloo
on the CPU), which measures one step with ``probes/step_memory.py::measure_step`` (a warm-up step, then a
step under PyTorch's ``MemTracker`` / ``FSDPMemTracker``); every rank's figures are gathered and the rank
with the largest peak is compared. The planner's figures for the same flags come from
``plan/estimate.py::estimate`` of ``workload_from_config`` / ``layout_from_config`` (what ``lmforge
estimate --json --gpu cpu`` computes, as ``plan/limit.py::planned_peak`` does, without the command's FP8
refusal of the CPU's units) given the run's real tokenizer vocabulary, the CPU device type and the attention kernel a
CPU run gets. The tracker sees tensors only, so the planner's tracked part ``total - overhead`` (overhead:
the runtime and fragmentation allowance) is compared with the tracker's peak.

A full run writes ``docs/memory-accuracy.md`` (:func:`write_doc`) and ``src/lmforge/plan/accuracy.json``
(:func:`write_json`, read by ``lmforge.plan.accuracy.load_accuracy``); both are functions of the
collected results only. Cases the planner does not model (:data:`NOT_MODELLED`) are not run: the doc lists
them with the planner's one-line refusal.

``--device cuda`` runs the one-process cases on the machine's GPU (``train.device=cuda``; a case on more
processes needs a GPU each, so none here) and plans them for that GPU (``plan/hardware.py::
from_device_name``, the attention kernel a CUDA run gets). Besides the tracker's peak, the worker reads
the caching allocator's: ``torch.cuda.max_memory_allocated()`` over the measured step, after
``reset_peak_memory_stats`` (it counts the same tensors plus what kernels allocate for themselves, such
as cuBLAS's workspace, and the allocator's rounding of each block to 512 bytes). It writes
``docs/memory-accuracy-cuda.md`` (:func:`render_cuda_doc`), not the CPU files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "memory-accuracy.md"
MEMORY_DOC = REPO / "docs" / "memory.md"  # its "How exact it is" opens with the block summary_block writes
BLOCK = ("<!-- planner-accuracy: start (python benchmarks/planner_accuracy.py writes this) -->",
         "<!-- planner-accuracy: end -->")  # fmt: skip
JSON_OUT = REPO / "src" / "lmforge" / "plan" / "accuracy.json"
CUDA_DOC = REPO / "docs" / "memory-accuracy-cuda.md"
TOLERANCE = 0.05
COMMAND = "python benchmarks/planner_accuracy.py"
ROWS = ("parameters", "gradients", "optimizer states", "activations", "temporaries")
# the stdlib modules the corpus is cut from (one document per function-sized chunk), as tests/conftest.py
CORPUS_MODULES = (
    "abc.py", "bisect.py", "calendar.py", "colorsys.py", "copy.py", "csv.py", "difflib.py", "fnmatch.py",
    "fractions.py", "functools.py", "glob.py", "heapq.py", "keyword.py", "linecache.py", "numbers.py",
    "operator.py", "queue.py", "random.py", "sched.py", "shlex.py", "statistics.py", "string.py",
    "textwrap.py", "timeit.py", "tokenize.py", "types.py", "uuid.py", "weakref.py",
)  # fmt: skip

# the shape every case starts from: none of it the default recipe's
BASE = {
    "data.vocab_size": 512,
    "data.seq_len": 64,
    "data.val_fraction": 0.1,
    "model.n_layers": 2,
    "model.d_model": 64,
    "model.n_heads": 4,
    "train.steps": 20,
    "train.micro_batch_size": 2,
    "train.precision": "fp32",
    "train.compile": False,
    "train.eval_interval": 10,
    "train.eval_tokens": 1024,
    "train.checkpoint_interval": 10,
    "train.log_interval": 5,
    "train.sample_tokens": 8,
    "schedule.warmup": 5,
    "optim.lr": 3e-3,
}
GQA = {"model.arch": "llama", "model.n_heads": 4, "model.n_kv_heads": 2}
GPT2 = {"model.arch": "gpt2"}
UNTIED = {"model.tie_embeddings": False}
MOE = {"model.moe.experts": 4, "model.moe.top_k": 2}


@dataclass(frozen=True)
class Case:
    """One recipe of the matrix: overrides over :data:`BASE` and the processes it runs on."""

    name: str
    processes: int
    flags: dict = field(default_factory=dict)

    def overrides(self) -> dict:
        """:data:`BASE` under this case's flags (without the corpus and cache paths)."""
        return BASE | self.flags


def _case(name: str, processes: int, **groups) -> Case:
    flags: dict = {}
    for g in groups.pop("use", ()):
        flags |= g
    flags |= {k.replace("__", "."): v for k, v in groups.items()}
    return Case(name, processes, flags)


def _shard(n: int, zero: int) -> dict:
    return {"parallel.dp_shard": n, "parallel.zero": zero}


CASES = [
    # one process
    _case("one-fp32-adamw-llama", 1, use=[GQA]),
    _case("one-bf16-gpt2-adamw", 1, use=[GPT2], train__precision="bf16"),
    _case("one-bf16-gpt2-selective-adamw8bit", 1, use=[GPT2, {"train.activation_checkpointing": "selective"}],
          train__precision="bf16", optim__name="adamw8bit", model__d_model=128),
    _case("one-fp32-gpt2-muon-untied", 1, use=[GPT2, UNTIED], optim__name="muon", train__loss_chunk=0),
    _case("one-fp32-every2-lion-accum2", 1, use=[GQA], model__n_layers=4, optim__name="lion",
          train__activation_checkpointing="every:2", train__tokens_per_step=256),
    _case("one-fp32-full-sgd", 1, use=[GQA, UNTIED], optim__name="sgd", train__activation_checkpointing="full"),
    _case("one-fp32-adafactor-seq128", 1, use=[GPT2], optim__name="adafactor", data__seq_len=128),
    _case("one-fp16-adam", 1, use=[GQA], train__precision="fp16", optim__name="adam"),
    _case("one-fp8-adamw", 1, use=[GQA], train__precision="fp8", model__d_model=128),
    # DDP and ZeRO-1 (two processes)
    _case("ddp-fp32-adamw", 2, use=[GQA], parallel__dp_replicate=2),
    _case("ddp-bf16-gpt2-untied-accum2", 2, use=[GPT2, UNTIED], parallel__dp_replicate=2,
          train__precision="bf16", train__tokens_per_step=512),
    _case("zero1-fp32-lion", 2, use=[GQA, _shard(2, 1)], optim__name="lion"),
    _case("zero1-fp32-adamw-gpt2", 2, use=[GPT2, _shard(2, 1)], model__d_model=128),
    # FSDP2: ZeRO-2 / ZeRO-3
    _case("zero2-fp32-adamw", 2, use=[GQA, _shard(2, 2)]),
    _case("zero2-bf16-gpt2-untied-adafactor", 2, use=[GPT2, UNTIED, _shard(2, 2)], train__precision="bf16",
          optim__name="adafactor"),
    _case("zero3-fp32-adamw-gqa", 2, use=[GQA, UNTIED, _shard(2, 3)], model__n_layers=4),
    _case("zero3-bf16-llama-gqa-untied", 2, use=[GQA, UNTIED, _shard(2, 3)], train__precision="bf16"),
    _case("zero3-fp32-selective-gqa", 2, use=[GQA, _shard(2, 3)], train__activation_checkpointing="selective"),
    _case("zero3-fp32-full-accum2-defer", 2, use=[GQA, _shard(2, 3)], train__activation_checkpointing="full",
          train__tokens_per_step=512, parallel__defer_grad_sync=True),
    _case("zero3-fp32-accum2-muon", 2, use=[GPT2, _shard(2, 3)], optim__name="muon", train__tokens_per_step=512),
    _case("zero3-bf16-adamw8bit-d128", 2, use=[GQA, _shard(2, 3)], train__precision="bf16",
          optim__name="adamw8bit", model__d_model=128),
    # hybrid sharding, tensor and pipeline parallelism
    _case("hsdp-2x2-fp32-adamw", 4, use=[GQA], parallel__dp_replicate=2, parallel__dp_shard=2),
    _case("tp2-fp32-adamw", 2, use=[GQA, UNTIED], parallel__tp=2),
    _case("tp2-bf16-sgd", 2, use=[GQA], parallel__tp=2, train__precision="bf16", optim__name="sgd"),
    _case("tp2-fsdp2-fp32-adamw", 4, use=[GQA, UNTIED, _shard(2, 3)], parallel__tp=2),
    _case("pp2-gpipe-fp32-adamw", 2, use=[GQA, UNTIED], model__n_layers=4, parallel__pp=2,
          parallel__pp_schedule="gpipe", train__micro_batch_size=4),
    _case("pp2-1f1b-fp32-adamw", 2, use=[GQA, UNTIED], model__n_layers=4, parallel__pp=2,
          parallel__pp_schedule="1f1b", train__micro_batch_size=4),
    _case("pp2-interleaved-fp32-lion", 2, use=[GPT2, UNTIED], model__n_layers=4, parallel__pp=2,
          parallel__pp_schedule="interleaved_1f1b", train__micro_batch_size=4, optim__name="lion"),
    _case("pp2-zero-bubble-fp32-adamw", 2, use=[GQA, UNTIED], model__n_layers=4, parallel__pp=2,
          parallel__pp_schedule="zero_bubble", train__micro_batch_size=4),
    _case("pp2-zbv-fp32-sgd", 2, use=[GQA, UNTIED], model__n_layers=4, parallel__pp=2,
          parallel__pp_schedule="zbv", train__micro_batch_size=4, optim__name="sgd"),
    # mixture of experts (4 experts, top-2): one process, and expert parallelism over 2 DDP ranks
    _case("one-moe-fp32-adamw", 1, use=[GQA, MOE]),
    _case("one-moe-bf16-full-shared", 1, use=[GQA, MOE], train__precision="bf16", model__moe__shared_experts=1,
          train__activation_checkpointing="full"),
    _case("ddp-ep2-moe-fp32-adamw", 2, use=[GQA, MOE], parallel__dp_replicate=2, parallel__ep=2),
]  # fmt: skip
BY_NAME = {c.name: c for c in CASES}
QUICK = ["one-fp32-adamw-llama", "one-bf16-gpt2-adamw", "zero3-fp32-adamw-gqa", "ddp-fp32-adamw"]
# the subset tests/test_planner_accuracy.py runs (every layout kind, shapes not all the default)
TEST_CASES = [
    "one-fp32-adamw-llama",
    "one-bf16-gpt2-selective-adamw8bit",
    "one-fp32-every2-lion-accum2",
    "ddp-fp32-adamw",
    "zero1-fp32-lion",
    "zero2-bf16-gpt2-untied-adafactor",
    "zero3-bf16-llama-gqa-untied",
    "zero3-fp32-selective-gqa",
    "tp2-fp32-adamw",
    "pp2-1f1b-fp32-adamw",
    "pp2-interleaved-fp32-lion",
    "pp2-zero-bubble-fp32-adamw",
    "pp2-zbv-fp32-sgd",
    "one-moe-bf16-full-shared",
    "ddp-ep2-moe-fp32-adamw",
]
# what the planner does not model: lmforge estimate refuses these flags in one line (plan/request.py)
NOT_MODELLED = [
    _case("zero3-fp32-offload", 2, use=[GQA, _shard(2, 3)], parallel__offload=True),
    _case("one-fp32-activation-offload", 1, use=[GQA], train__activation_offload=True),
    _case("one-fp32-dpo", 1, use=[GQA], train__objective="dpo"),
    _case("one-fp64-adamw", 1, use=[GQA], train__precision="fp64"),
    _case("one-moe-selective", 1, use=[GQA, MOE], train__activation_checkpointing="selective"),
]


# --- measuring ---------------------------------------------------------------------------------------


def corpus(workdir: Path) -> Path:
    """A JSONL corpus of a few standard-library modules under ``workdir`` (written once)."""
    path = workdir / "corpus" / "stdlib.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        lines = []
        for name in CORPUS_MODULES:
            text = (stdlib / name).read_text(encoding="utf-8")
            for i, chunk in enumerate(text.split("\ndef ")):
                if len(chunk) > 40:
                    lines.append(json.dumps({"id": f"{name}#{i}", "text": ("def " if i else "") + chunk}))
        path.write_text("\n".join(lines) + "\n")
    return path


def run_overrides(case: Case, workdir: Path, device: str = "cpu") -> dict:
    """The overrides a worker builds the run from: the case's, the corpus, a cache per vocabulary and the
    device."""
    over = case.overrides()
    cache = workdir / f"cache-v{over['data.vocab_size']}"
    paths = {"data.sources": [{"path": str(corpus(workdir))}], "data.cache_dir": str(cache)}
    return over | paths | {"train.device": device}


def measure(case: Case, workdir: Path, timeout: float = 600, device: str = "cpu", launch=None) -> dict:
    """Run the case's worker; ``{"ranks": [{"total", "rows", "categories", "states"[, "allocator"]}, ...],
    "vocab_size"[, "device_name"]}`` (``allocator``, ``device_name``: on CUDA). ``launch(nproc, args,
    timeout) -> CompletedProcess`` starts a multi-process case instead of ``torchrun`` (the tests' warm
    launcher)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "PYTHONFAULTHANDLER": "1"}
    args = [__file__, "--worker", json.dumps(run_overrides(case, workdir, device))]
    if case.processes > 1 and launch is not None:
        proc = launch(case.processes, args, timeout)
    elif case.processes > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={case.processes}",
        ]
        proc = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)
    else:
        proc = subprocess.run(
            [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STEP ")]
    if proc.returncode != 0 or len(lines) != 1:
        raise RuntimeError(
            f"{case.name}: worker failed ({proc.returncode})\n{proc.stdout[-2000:]}{proc.stderr[-20000:]}"
        )
    return json.loads(lines[0].removeprefix("STEP "))


def worker(overrides_json: str) -> None:
    """In each process: build the run, measure one step, gather every rank's figures; rank 0 prints them."""
    import torch
    import torch.distributed as dist

    from lmforge.parallel.layout import close_layout
    from lmforge.probes.step_memory import measure_step, take_step
    from lmforge.recipe import load_config
    from lmforge.train.build import build_run

    torch.set_num_threads(1)
    run = build_run(load_config(None, json.loads(overrides_json)))
    cuda = run.device.type == "cuda"
    finished = False
    try:
        extra = {}
        if cuda:  # the warm-up step here, so that the allocator's peak covers the measured step only
            take_step(run)
            torch.cuda.synchronize(run.device)
            torch.cuda.reset_peak_memory_stats(run.device)
        m = measure_step(run, warmup=0 if cuda else 1)
        if cuda:
            torch.cuda.synchronize(run.device)
            extra = {"allocator": int(torch.cuda.max_memory_allocated(run.device))}
        mine = {"total": m.total, "rows": m.rows(), "categories": m.categories, "states": m.states, **extra}
        ranks = [mine]
        if dist.is_available() and dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        if run.layout.is_main:
            print(
                "STEP "
                + json.dumps(
                    {"ranks": ranks, "vocab_size": run.data.tokenizer.vocab_size}
                    | ({"device_name": torch.cuda.get_device_name(run.device)} if cuda else {})
                ),
                flush=True,
            )
        finished = True
    finally:  # the process group ends before interpreter shutdown (parallel/layout.py::end_process_group)
        close_layout(run.layout, finished)


# --- planning and comparing --------------------------------------------------------------------------


def planner_config(case: Case, vocab_size: int):
    """The case's recipe as the planner reads it, with the run's real tokenizer vocabulary."""
    from lmforge.recipe import load_config

    return load_config(None, case.overrides() | {"data.vocab_size": vocab_size})


def plan(case: Case, vocab_size: int, device_name: str | None = None) -> dict:
    """The planner's rows at its peak phase, the tracked part of its peak and the phase's name; for the
    CPU, or for the CUDA device ``device_name`` (``torch.cuda.get_device_name``)."""
    from lmforge.plan.activations import attention_kind
    from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
    from lmforge.plan.hardware import GPUS, cpu, from_device_name

    device = "cuda" if device_name else "cpu"
    cfg = planner_config(case, vocab_size)
    layout = layout_from_config(cfg, case.processes)
    attention = attention_kind(device, cfg.train.attention, cfg.model.doc_mask)
    workload = workload_from_config(cfg, cfg.train.precision, attention, device)
    if device_name:  # memory only is compared: a GPU the table lacks is planned as an H100
        hw = from_device_name(device_name) or GPUS["h100-80gb"]
    else:  # only memory is compared: the FLOP/s are placeholders (FP8's too, emulated on a CPU)
        hw = cpu(1.0)
        hw = replace(hw, peak_flops=hw.peak_flops | {"fp8": 1.0})
    est = estimate(workload, layout, hw)
    rows = est.rows()
    states = {
        "parameters": round(est.states.params + est.states.master + est.buffers),
        "gradients": round(est.states.grads),
        "optimizer states": round(est.states.optim),
    }
    return {
        "states": states,
        "pp_rank": est.pp_rank,
        # lmforge accounting keeps no separate master copy; any is counted with the parameters
        "parameters": round(rows["parameters"] + rows["master weights"]),
        "gradients": round(rows["gradients"]),
        "optimizer states": round(rows["optimizer states"]),
        "activations": round(rows["activations"]),
        "temporaries": round(rows["temporaries"]),
        "peak": round(est.total - est.overhead),
        "phase": est.peak_phase,
    }


def refusal(case: Case) -> str:
    """``lmforge estimate``'s one-line refusal of a case the planner does not model ('' if it plans it)."""
    from lmforge.errors import UserError
    from lmforge.plan.request import EstimateRequest, run_estimate

    flags = tuple(f"--{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in case.overrides().items())  # fmt: skip
    try:
        run_estimate(EstimateRequest(gpu="h100-80gb", gpus=case.processes, overrides=flags))
    except UserError as exc:
        return str(exc)
    return ""


def _layout(case: Case) -> str:
    f = case.overrides()
    pp, tp = f.get("parallel.pp", 1), f.get("parallel.tp", 1)
    rep, shard = f.get("parallel.dp_replicate", 1), f.get("parallel.dp_shard", 1)
    parts = []
    if shard > 1:
        parts.append(f"hsdp {rep}x{shard}" if rep > 1 else f"zero{f.get('parallel.zero', 3)} x{shard}")
    elif rep > 1:
        parts.append(f"ddp x{rep}")
    if tp > 1:
        parts.append(f"tp {tp}")
    if pp > 1:
        parts.append(f"pp {pp} {f.get('parallel.pp_schedule', '1f1b')}")
    return " + ".join(parts) or "one process"


def compare(case: Case, measured: dict, planned: dict) -> dict:
    """One case's record (the JSON shape ``lmforge.plan.accuracy`` reads): the largest measured rank."""
    rank = max(measured["ranks"], key=lambda r: r["total"])
    rows = {k: int(rank["rows"][k]) for k in ROWS} | {"peak": int(rank["total"])}
    f = case.overrides()
    planned = dict(planned)
    planned_states, pp_rank = planned.pop("states"), planned.pop("pp_rank")
    # the planner's states are those of its peak's pipeline rank (mesh order pp first: global ranks
    # pp_rank * world / pp onwards); the largest of that rank's data- and tensor-parallel ranks
    per_stage = len(measured["ranks"]) // f.get("parallel.pp", 1)
    stage = measured["ranks"][pp_rank * per_stage : (pp_rank + 1) * per_stage]
    largest = {k: max(r["states"][k] for r in stage) for k in planned_states}
    return {
        "name": case.name,
        "processes": case.processes,
        "flags": case.flags,
        "layout": _layout(case),
        "precision": f["train.precision"],
        "optimizer": f.get("optim.name", "adamw"),
        "planned": planned,
        "measured": rows,
        "peak_error": planned["peak"] / rows["peak"] - 1,
        # the model states, tensor by tensor after the step's backward (the planner plans the largest rank)
        "states": {"planned": planned_states, "measured": largest},
        "inputs": int(rank["rows"].get("inputs", 0)),  # batch tensors: in the measured peak, no row
    } | ({"allocator_peak": rank["allocator"]} if "allocator" in rank else {})


def summary(cases: list[dict]) -> dict:
    """Distribution of ``|peak error|`` over the cases, the count within :data:`TOLERANCE`, the worst."""
    errs = sorted(abs(c["peak_error"]) for c in cases)
    if not errs:
        return {"cases": 0, "within_tolerance": 0, "median_abs_peak_error": 0.0, "p90_abs_peak_error": 0.0,
                "max_abs_peak_error": 0.0, "worst": ""}  # fmt: skip
    worst = max(cases, key=lambda c: abs(c["peak_error"]))
    p90 = errs[min(len(errs) - 1, max(0, round(0.9 * len(errs)) - 1))]
    return {
        "cases": len(cases),
        "within_tolerance": sum(e <= TOLERANCE for e in errs),
        "median_abs_peak_error": statistics.median(errs),
        "p90_abs_peak_error": p90,
        "max_abs_peak_error": errs[-1],
        "worst": worst["name"],
    }


# --- writing -----------------------------------------------------------------------------------------


def machine() -> str:
    """The CPU's model name and core count (lscpu), for the doc and the JSON."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        info = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines() if ":" in ln)}
        flags = set(info.get("Flags", "").split())
        units = [
            name for flag, name in (("avx512_bf16", "AVX-512-BF16"), ("amx_bf16", "AMX")) if flag in flags
        ]
        return f"{info['Model name']}, {info['CPU(s)']} cores{' with ' + '/'.join(units) if units else ''} (lscpu)"
    except (OSError, KeyError, subprocess.SubprocessError):
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def record(results: list[dict]) -> dict:
    """The accuracy file's object for ``results`` (:func:`compare`'s records)."""
    import torch

    cases = [{k: v for k, v in r.items() if k != "inputs"} for r in results]
    return {
        "machine": machine(),
        "torch": torch.__version__,
        "date": date.today().isoformat(),
        "tolerance": TOLERANCE,
        "cases": cases,
        "summary": summary(cases),
    }


def write_json(data: dict, path: Path = JSON_OUT) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _err(planned: float, measured: float) -> str:
    if measured == 0:
        return "exact" if planned == 0 else "(none measured)"
    e = planned / measured - 1
    return "exact" if abs(planned - measured) <= 8 else f"{e:+.1%}"


STATE_SLACK = 16  # bytes: states are counted tensor by tensor, so exact but for scalars


def _states_exact(c: dict) -> bool:
    st = c.get("states", {})
    return bool(st) and all(abs(st["planned"][k] - st["measured"][k]) <= STATE_SLACK for k in st["planned"])


def _states_off(c: dict) -> str:
    st = c.get("states")
    if not st:
        return "(not measured)"
    return ", ".join(f"{k} {st['planned'][k] - st['measured'][k]:+,} B" for k in st["planned"])


def case_table(c: dict) -> list[str]:
    """One case's markdown table: planned, measured (KiB) and the error, per row and the peak."""
    p, m = c["planned"], c["measured"]
    lines = ["| row | planned KiB | measured KiB | error |", "|---|---:|---:|---:|"]
    for row in (*ROWS, "peak"):
        lines.append(f"| {row} | {_kib(p[row])} | {_kib(m[row])} | {_err(p[row], m[row])} |")
    st = c.get("states")
    for row in st["planned"] if st else ():
        sp, sm = st["planned"][row], st["measured"][row]
        lines.append(f"| {row}, all of them | {_kib(sp)} | {_kib(sm)} | {_err(sp, sm)} |")
    return lines


def render_doc(
    data: dict, refused: list[tuple[Case, str]], failed: list[tuple[Case, str]], command: str
) -> str:
    """``docs/memory-accuracy.md`` for the accuracy object ``data``, the refused cases and those whose run
    failed."""
    s, cases = data["summary"], data["cases"]
    out = [
        "# How exact the memory planner is: the measured matrix",
        "",
        f"Generated by `{command}` on {data['date']}: {data['machine']}, torch {data['torch']}, "
        "gloo on the CPU. Do not edit by hand; re-run the script.",
        "",
        "Each case is a tiny recipe built by `train/build.py::build_run` (one process, or 2-4 processes under "
        "`torchrun`), one warm-up step, then one step measured by `probes/step_memory.py::measure_step` "
        "(PyTorch's `MemTracker`, or `FSDPMemTracker` when the model holds FSDP2 units; the rank with the "
        "largest peak; the zero-bubble schedules' steps, whose split backward the trackers' module hooks "
        "cannot follow, by `StoragePeak`, the same storage accounting without the hooks: their peak and "
        "model states are measured, their rows are not). The planned figures are `lmforge estimate`'s (`plan/estimate.py::estimate` for the "
        "same flags, the run's real tokenizer vocabulary, the CPU's attention kernel); the planned peak is "
        "its tracked part, `total - overhead` (the tracker sees tensors, not the runtime or the allocator's "
        "fragmentation). Rows are the planner's rows at its peak phase against the tracker's categories at "
        "its peak moment (a row's error says as much about when each peak falls as about the row); the "
        "measured parameters row holds the model's buffers too (Llama's RoPE tables), and the measured peak "
        "the batch's token tensors (a few KiB, no row). Errors are planned / measured - 1; a state row within "
        "8 bytes reads `exact`.",
        "",
        "## Summary",
        "",
        f"- cases: {s['cases']}; peak within {data['tolerance']:.0%}: {s['within_tolerance']}",
        f"- |peak error|: median {s['median_abs_peak_error']:.1%}, p90 {s['p90_abs_peak_error']:.1%}, "
        f"max {s['max_abs_peak_error']:.1%} (worst case: `{s['worst']}`)",
        f"- model states (parameters with the buffers, gradients, optimizer states; every rank's largest, "
        f"counted tensor by tensor when the step's gradients are complete): exact to 16 bytes in "
        f"{sum(_states_exact(c) for c in cases)} of {len(cases)} cases"
        + "".join(f"; `{c['name']}` off by {_states_off(c)}" for c in cases if not _states_exact(c)),
        "",
        "| case | procs | layout | precision | optimizer | planned peak KiB | measured peak KiB | peak error | "
        "planned phase |",
        "|---|---:|---|---|---|---:|---:|---:|---|",
    ]
    for c in cases:
        out.append(
            f"| `{c['name']}` | {c['processes']} | {c['layout']} | {c['precision']} | {c['optimizer']} | "
            f"{_kib(c['planned']['peak'])} | {_kib(c['measured']['peak'])} | {c['peak_error']:+.1%} | "
            f"{c['planned']['phase']} |"
        )
    if refused:
        out += [
            "",
            "## Not modelled",
            "",
            "`lmforge estimate` refuses these in one line; they are not run:",
            "",
        ]
        out += [
            f"- `{c.name}` ({', '.join(f'`{k}={v}`' for k, v in c.flags.items())}): {msg}"
            for c, msg in refused
        ]
    if failed:
        out += [
            "",
            "## Failed to run",
            "",
            "These cases' workers failed; they are not in the figures above:",
            "",
        ]
        out += [f"- `{c.name}` ({c.processes} process(es)): `{msg}`" for c, msg in failed]
    out += ["", "## Per case", ""]
    for c in cases:
        flags = ", ".join(f"`{k}={v}`" for k, v in c["flags"].items())
        out += [f"### `{c['name']}`", "", f"{c['processes']} process(es), {c['layout']}; flags over the base: "
                f"{flags}. Planned peak phase: {c['planned']['phase']}.", "", *case_table(c), ""]  # fmt: skip
    base = ", ".join(f"`{k}={v}`" for k, v in BASE.items())
    out += ["## The base recipe", "", f"Every case starts from {base}.", ""]
    return "\n".join(out)


def summary_block(data: dict) -> str:
    """The paragraph docs/memory.md's "How exact it is" opens with: the matrix's figures, from ``data``."""
    s, cases = data["summary"], data["cases"]
    first = [c["layout"].split(" + ")[0] for c in cases]
    layouts = sorted({f if f == "one process" else f.split(" ")[0] for f in first})
    exact = sum(_states_exact(c) for c in cases)
    off = [c for c in cases if abs(c["peak_error"]) > data["tolerance"]]
    return "\n".join(
        [
            BLOCK[0],
            f"Measured ({data['date']}, {data['machine']}, torch {data['torch']}; "
            f"[memory-accuracy.md](memory-accuracy.md) has every case): {s['cases']} recipes built by "
            f"`build_run` ({', '.join(layouts)}; {', '.join(sorted({c['precision'] for c in cases}))}; "
            f"{', '.join(sorted({c['optimizer'] for c in cases}))}), one real step each under PyTorch's "
            f"`MemTracker` / `FSDPMemTracker`, against `lmforge estimate` for the same flags. The planned peak "
            f"(less the overhead the trackers cannot see) is within {data['tolerance']:.0%} of the measured "
            f"one in {s['within_tolerance']} of {s['cases']}; |peak error| median "
            f"{s['median_abs_peak_error']:.1%}, p90 {s['p90_abs_peak_error']:.1%}, max "
            f"{s['max_abs_peak_error']:.1%} (`{s['worst']}`)"
            + "".join(f"; over {data['tolerance']:.0%}: `{c['name']}` {c['peak_error']:+.1%}" for c in off)
            + f". Parameters (with the buffers), gradients and optimizer states, every rank's largest, are "
            f"exact to 16 bytes in {exact} of {s['cases']}.",
            BLOCK[1],
        ]
    )


def write_summary_block(data: dict, path: Path = MEMORY_DOC) -> None:
    """Replace the marked block of ``path`` with :func:`summary_block` (ValueError if it has none)."""
    text = path.read_text()
    start, end = text.find(BLOCK[0]), text.find(BLOCK[1])
    if start < 0 or end < start:
        raise ValueError(f"{path}: no {BLOCK[0]} ... {BLOCK[1]} block to fill")
    path.write_text(text[:start] + summary_block(data) + text[end + len(BLOCK[1]) :])


def print_table(results: list[dict]) -> None:
    head = f"{'case':38} {'p':>1} {'peak plan':>10} {'meas':>10} {'err':>7}  " + "  ".join(
        f"{r[:6]:>7}" for r in ROWS
    )
    print(head)
    for c in results:
        p, m = c["planned"], c["measured"]
        errs = "  ".join(f"{_err(p[r], m[r])[:7]:>7}" for r in ROWS)
        print(f"{c['name']:38} {c['processes']:>1} {p['peak']:>10,} {m['peak']:>10,} {c['peak_error']:>+7.1%}  {errs}"
              f"  [{p['phase']}]")  # fmt: skip


def run_cases(
    cases: list[Case], workdir: Path, device: str = "cpu"
) -> tuple[list[dict], list[tuple[Case, str]]]:
    """Measure and plan every case (one worker at a time), printing each as it finishes; the records, and
    the cases whose worker failed with the last line of its error (listed in the doc, not hidden)."""
    results, failed = [], []
    start = time.time()
    for i, case in enumerate(cases):
        t0 = time.time()
        if i:  # the cases so far set the pace: about 5-20 s each on 2 cores
            left = (t0 - start) / i * (len(cases) - i)
            print(f"[{i + 1}/{len(cases)}] {case.name} ({case.processes} process(es)), about {left:.0f} s left",
                  flush=True)  # fmt: skip
        try:
            measured = measure(case, workdir, device=device)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error:" in ln and "ChildFailedError" not in ln]
            last = (errors or lines)[-1]
            failed.append((case, last))
            (workdir / f"{case.name}.err").write_text(str(exc))  # the whole error, for whoever looks
            print(f"{case.name}: FAILED: {last}", flush=True)
            continue
        try:
            planned = plan(case, measured["vocab_size"], measured.get("device_name"))
        except (KeyError, ValueError) as exc:
            failed.append((case, f"planner: {exc}"))
            print(f"{case.name}: FAILED: planner: {exc}", flush=True)
            continue
        result = compare(case, measured, planned)
        results.append(result)
        print(f"{case.name}: peak error {result['peak_error']:+.1%} ({time.time() - t0:.0f} s)", flush=True)
    return results, failed


def render_cuda_doc(data: dict, skipped: list[Case], failed: list[tuple[Case, str]], command: str) -> str:
    """``docs/memory-accuracy-cuda.md``: each case's planned peak against the tracker's and the caching
    allocator's (``data``: :func:`record` of a ``--device cuda`` run, with ``device_name``)."""
    cases = data["cases"]

    def within(key: str) -> int:
        return sum(abs(c["planned"]["peak"] / c[key] - 1) <= data["tolerance"] for c in cases)

    against_allocator = summary(
        [{"name": c["name"], "peak_error": c["planned"]["peak"] / c["allocator_peak"] - 1} for c in cases]
    )
    out = [
        "# How exact the memory planner is on a GPU",
        "",
        f"Generated by `{command}` on {data['date']}: {data['device_name']}, torch {data['torch']}. "
        "Do not edit by hand; re-run the script on a machine with a GPU.",
        "",
        "The one-process cases of [the CPU matrix](memory-accuracy.md) (one GPU each is needed; the "
        "multi-process cases run where there are that many), each built by `build_run` with "
        "`train.device=cuda`, one warm-up step, then one step measured twice at once: PyTorch's "
        "`MemTracker` (the tensors alive at its peak) and `torch.cuda.max_memory_allocated()` over the "
        "step (the caching allocator's peak: the same tensors, each block rounded up to 512 bytes, plus "
        "what kernels allocate for themselves, such as cuBLAS's workspace). Planned: `lmforge estimate` "
        "for the same flags on this GPU, its tracked part `total - overhead`.",
        "",
        f"- cases: {len(cases)}; planned peak within {data['tolerance']:.0%} of the tracker's: "
        f"{within('measured_peak')}, of the allocator's: {within('allocator_peak')}",
        f"- |error| against the allocator's peak: median {against_allocator['median_abs_peak_error']:.1%}, "
        f"max {against_allocator['max_abs_peak_error']:.1%}",
        "",
        "| case | precision | optimizer | planned KiB | tracker peak KiB | allocator peak KiB | error (tracker) "
        "| error (allocator) | planned phase |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in cases:
        p, t, a = c["planned"]["peak"], c["measured_peak"], c["allocator_peak"]
        out.append(
            f"| `{c['name']}` | {c['precision']} | {c['optimizer']} | {_kib(p)} | {_kib(t)} | {_kib(a)} | "
            f"{p / t - 1:+.1%} | {p / a - 1:+.1%} | {c['planned']['phase']} |"
        )
    if skipped:
        out += [
            "",
            f"Not run (more processes than this machine's GPUs): {', '.join(f'`{c.name}`' for c in skipped)}.",
        ]
    if failed:
        out += ["", "## Failed to run", ""] + [f"- `{c.name}`: `{msg}`" for c, msg in failed]
    return "\n".join(out) + "\n"


def run_cuda(names: list[str] | None, workdir: Path) -> int:
    """``--device cuda``: the cases that fit this machine's GPUs, measured and planned on CUDA; writes
    :data:`CUDA_DOC`. Exit status 2, before any work, where no GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        print("planner_accuracy.py: --device cuda: no CUDA device is visible here (torch.cuda.is_available() "
              "is False); run it on a machine with a GPU, or leave --device out for the CPU matrix",
              file=sys.stderr)  # fmt: skip
        return 2
    cases = [BY_NAME[n] for n in names] if names else list(CASES)
    gpus = torch.cuda.device_count()
    skipped = [c for c in cases if c.processes > gpus]
    results, failed = run_cases([c for c in cases if c.processes <= gpus], workdir, device="cuda")
    print_table(results)
    data = record(results) | {"device_name": torch.cuda.get_device_name(0)}
    for c in data["cases"]:
        c["measured_peak"] = c["measured"]["peak"]
    CUDA_DOC.write_text(render_cuda_doc(data, skipped, failed, COMMAND + " --device cuda"))
    print(f"wrote {CUDA_DOC.relative_to(REPO)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--write", action="store_true", help="write the doc and JSON for a subset too")
    ap.add_argument("--workdir", default="/tmp/lmforge-planner-accuracy", help="corpus and tokenizer cache")
    ap.add_argument("--render", action="store_true", help="only rewrite the doc from the JSON file")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help=f"cuda: the cases that fit this machine's GPUs, on CUDA; writes {CUDA_DOC.name}")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.render:
        refused = [(c, refusal(c)) for c in NOT_MODELLED]
        data = json.loads(JSON_OUT.read_text())
        DOC.write_text(render_doc(data, refused, [], COMMAND))
        write_summary_block(data)
        return 0
    names = args.cases.split(",") if args.cases else QUICK if args.quick else [c.name for c in CASES]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if args.device == "cuda":
        return run_cuda(names if args.cases or args.quick else None, Path(args.workdir))
    results, failed = run_cases([BY_NAME[n] for n in names], Path(args.workdir))
    print_table(results)
    data = record(results)
    s = data["summary"]
    print(f"within {TOLERANCE:.0%}: {s['within_tolerance']}/{s['cases']}; |peak error| median "
          f"{s['median_abs_peak_error']:.1%}, p90 {s['p90_abs_peak_error']:.1%}, max {s['max_abs_peak_error']:.1%} "
          f"({s['worst']})")  # fmt: skip
    if args.write or not (args.cases or args.quick):
        refused = [(c, refusal(c)) for c in NOT_MODELLED]
        write_json(data)
        DOC.write_text(render_doc(data, refused, failed, COMMAND))
        write_summary_block(data)
        print(f"wrote {DOC.relative_to(REPO)}, {JSON_OUT.relative_to(REPO)} and the summary in "
              f"{MEMORY_DOC.relative_to(REPO)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
