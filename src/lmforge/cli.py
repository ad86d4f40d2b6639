"""The ``lmforge`` command: parse arguments, load the config, dispatch. No logic of its own."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from lmforge.errors import ConfigError, Interrupted, UserError
from lmforge.recipe import load_config, parse_overrides, reference_text

log = logging.getLogger("lmforge")


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    return int(os.environ.get("RANK", "0") or 0)


def _setup_logging(verbose: bool) -> None:
    """Log to stderr; under torchrun only rank 0 logs progress, the other ranks warnings and errors."""
    level = logging.DEBUG if verbose else logging.INFO
    if _rank() > 0 and not verbose:
        level = logging.WARNING
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, show_time=False)
        fmt = "%(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
        fmt = "%(asctime)s %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    root = logging.getLogger("lmforge")
    root.handlers[:] = [handler]
    root.setLevel(level)


def _newest_run(runs: Path) -> Path | None:
    found = sorted(
        (p for p in runs.glob("*") if (p / "config.toml").is_file()), key=lambda p: p.stat().st_mtime
    )
    return found[-1] if found else None


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.train.checkpoint import latest_checkpoint
    from lmforge.train.launch import train
    from lmforge.train.resume import resume_config

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if "WORLD_SIZE" in os.environ and not args.run_dir:
        raise UserError(
            "--run-dir: required under torchrun, so that every process (and every restart) uses the same "
            "folder; pass --run-dir runs/NAME"
        )
    if args.run_dir:
        run_dir = Path(args.run_dir)
    elif args.resume:
        run_dir = _newest_run(Path("runs"))
        if run_dir is None:
            raise UserError("--resume: no run under runs/; pass --run-dir DIR of the run to continue")
    else:
        run_dir = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if restarted and latest_checkpoint(run_dir) is not None:  # torchrun brought the job back: continue it
        log.warning(
            "torchrun restart %s: resuming from the newest complete checkpoint",
            os.environ["TORCHELASTIC_RESTART_COUNT"],
        )
        args.resume = True
    if args.resume:  # the run's own config.toml is the base; the recipe and flags change it
        cfg = resume_config(run_dir, args.config, parse_overrides(extra))
    else:
        cfg = load_config(args.config, parse_overrides(extra))
    _print(f"run folder: {run_dir}")
    return _finish(train(cfg, run_dir, resume=args.resume), run_dir, "train")


def _finish(summary: dict, run_dir: Path, command: str) -> int:
    """Print how a run ended; the exit status (128 + signal number for a run stopped by a signal)."""
    if summary.get("stopped"):
        _print(
            f"stopped at step {summary['step']} ({summary['reason'] or 'requested'}); "
            f"checkpoint: {summary['checkpoint']}\n"
            f"continue with: lmforge {command} --resume --run-dir {run_dir}"
        )
        return 128 + signal.Signals[summary["reason"]].value if summary["reason"] in _SIGNALS else 0
    sample = summary.pop("sample", None)
    if "unigram_loss" in summary:
        losses = (
            f"val_loss {summary['val_loss']:.4f} (ppl {summary['val_ppl']:.2f}), unigram_loss "
            f"{summary['unigram_loss']:.4f}, ratio {summary['val_loss_over_unigram']:.3f}"
        )
    elif "val_loss" in summary:  # post-training: the held-out records
        extra = {
            k: v for k, v in summary.items() if k.startswith("val_") and k not in ("val_loss", "val_ppl")
        }
        losses = f"held-out loss {summary['val_loss']:.4f}" + "".join(
            f", {k} {v:.4f}" for k, v in extra.items()
        )
    else:
        losses = "no held-out records"
    _print(
        f"done: step {summary['step']}, {losses}, {summary['tokens_seen']:,} tokens in "
        f"{summary['wall_time_s']:.0f}s"
    )
    if sample is not None:
        _print("sample:\n" + sample)
    return 0


def cmd_posttrain(args: argparse.Namespace, extra: list[str]) -> int:
    """``lmforge sft`` / ``lmforge dpo``: start a post-training run from --from RUN, or --resume one."""
    from lmforge.train.finetune import start
    from lmforge.train.launch import train
    from lmforge.train.resume import resume_config

    kind = args.command
    overrides = parse_overrides(extra)
    if args.resume:
        if not args.run_dir:
            raise UserError(f"--run-dir: --resume needs the folder of the {kind} run to continue")
        if args.from_run:
            raise UserError(
                "--from: a resumed run keeps its start; drop --from (or drop --resume for a new run)"
            )
        run_dir = Path(args.run_dir)
        cfg = resume_config(run_dir, args.recipe, overrides)
        if cfg.train.objective != kind:
            raise UserError(
                f"--run-dir: {run_dir} is a train.objective = {cfg.train.objective} run; continue it with "
                f"lmforge {'train' if cfg.train.objective == 'lm' else cfg.train.objective} --resume"
            )
    else:
        if not args.from_run:
            raise UserError(f"--from: give the run to start from (lmforge {kind} --from runs/NAME)")
        run_dir = (
            Path(args.run_dir) if args.run_dir else Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        cfg, ckpt = start(kind, args.from_run, run_dir, args.recipe, overrides, args.step)
        _print(f"run folder: {run_dir} (started from {args.from_run}: {ckpt.name})")
        if args.prepare_only:
            _print(f"prepared; train with: lmforge {kind} --resume --run-dir {run_dir}")
            return 0
    return _finish(train(cfg, run_dir, resume=True), run_dir, kind)


def _print(text: str) -> None:
    """Print the result of a command once: from rank 0 under torchrun."""
    if _rank() == 0:
        print(text)


_SIGNALS = {s.name for s in signal.Signals}


def _device(name: str):
    from lmforge.train.runtime import pick_device

    return pick_device(name)


def cmd_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.train.run_loading import evaluate_run

    if args.tokens < 0:
        raise UserError(
            f"--tokens: {args.tokens} is out of range; give an integer >= 0 (0: train.eval_tokens)"
        )
    if args.data:
        return _eval_data(args)
    print(json.dumps(evaluate_run(args.run, _device(args.device), args.tokens)))
    return 0


def _eval_data(args: argparse.Namespace) -> int:
    from lmforge.train.eval_data import check_files, evaluate_files

    check_files(args.data, args.text_field)  # before loading the model
    result = evaluate_files(args.run, args.data, _device(args.device), args.text_field)
    if args.json:
        print(json.dumps(result))
        return 0
    rows = [[r["file"], f"{r['targets']:,}", f"{r['loss']:.4f}", f"{r['ppl']:.2f}"] for r in result["files"]]
    rows.append(["overall", f"{result['targets']:,}", f"{result['loss']:.4f}", f"{result['ppl']:.2f}"])
    widths = [max(len(x) for x in col) for col in zip(["file", "targets", "loss", "ppl"], *rows, strict=True)]
    print(f"{args.run} at step {result['step']}: mean next-token cross-entropy (nats) and perplexity")
    for row in [["file", "targets", "loss", "ppl"], *rows]:
        print(
            "  ".join(
                [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
            )
        )
    return 0


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.report.plots import select_panels, write_dashboard
    from lmforge.report.runs import open_run

    runs = [open_run(r) for r in args.runs]
    out = Path(args.out) if args.out else (runs[0].path / "plots" if len(runs) == 1 else Path("plots"))
    written = write_dashboard(runs, out, per_panel=not args.dashboard_only)
    if not written:
        raise UserError(f"RUN: {', '.join(args.runs)}: no metrics to draw yet (metrics.jsonl has no records)")
    events = sum(len(r.events()) for r in runs)
    print(f"{written[0]}: {', '.join(p.name for p in select_panels(runs))}; {events} events marked")
    if len(written) > 1:
        print(f"one PNG per panel beside it in {out}")
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.report.compare import compare, table_text
    from lmforge.report.runs import open_run

    result = compare([open_run(r) for r in args.runs])
    print(json.dumps(result) if args.json else table_text(result))
    return 0


def cmd_dashboard(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.web.app import create_app
    from lmforge.web.server import bind, url_of

    runs = Path(args.runs_dir)
    if not runs.is_dir():
        raise UserError(f"RUNS_DIR: {runs} is not a folder; give the folder that holds your run folders")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: {args.port} is out of range; give 0..65535 (0: any free port)")
    if args.poll_ms < 100:
        raise UserError(f"--poll-ms: {args.poll_ms} is too small; give at least 100")
    server = bind(create_app(runs, args.poll_ms), args.host, args.port)
    print(f"lmforge dashboard: {runs.resolve()} (read-only) at {url_of(server)}; Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def check_sampling_args(args: argparse.Namespace) -> None:
    """UserError naming the first ``generate`` flag out of its range."""
    rules = [
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "an integer >= 1"),
        ("--temperature", args.temperature, args.temperature >= 0, "a number >= 0 (0: greedy decoding)"),
        ("--top-k", args.top_k, args.top_k >= 0, "an integer >= 0 (0: no top-k cut)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "a number in (0, 1] (1: no nucleus cut)"),
        ("--num-samples", args.num_samples, args.num_samples >= 1, "an integer >= 1"),
    ]
    for flag, value, ok, want in rules:
        if not ok or value != value:  # NaN fails every comparison but the last
            raise UserError(f"{flag}: {value} is out of range; give {want}")


def cmd_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.model.sampling import generate
    from lmforge.posttrain.records import Turn
    from lmforge.posttrain.template import read_template
    from lmforge.train.run_loading import load_run

    check_sampling_args(args)
    device = _device(args.device)
    _, tok, model, _ = load_run(args.run, device)
    template = read_template(Path(args.run))  # a post-training run: the prompt is a user turn
    if template is not None:
        prompt, stop, shown = template.prompt_ids([Turn("user", args.prompt)]), template.end_id, ""
    else:
        prompt, stop, shown = [tok.eot_id, *tok.encode(args.prompt)], tok.eot_id, args.prompt
    for i in range(args.num_samples):
        ids = generate(
            model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_token=stop,
            seed=args.seed + i,
        )
        print(shown + tok.decode([t for t in ids if t != stop]))
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.hf.export import export_run

    print(f"exported to {export_run(args.run, args.out, args.step)}")
    return 0


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.hf.import_ import import_hf

    ckpt = import_hf(args.hf_dir, args.run_dir, args.config, parse_overrides(extra))
    print(
        f"imported to {args.run_dir} ({ckpt.name}); continue with: lmforge train --resume --run-dir {args.run_dir}"
    )
    return 0


def cmd_data(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.config import load_pipeline_config
    from lmforge.corpus.pipeline import Layout, run_pipeline, write_report
    from lmforge.data.tokenize_output import tokenize_output

    cfg = load_pipeline_config(args.config, parse_overrides(extra))
    start = time.perf_counter()
    report = run_pipeline(cfg, args.out, executor=args.executor, workers=args.workers)
    elapsed = time.perf_counter() - start
    if cfg.tokenize.enabled and not args.no_tokenize:
        report["tokens"] = tokenize_output(cfg, args.out)
        write_report(Layout(args.out).report, report)
    _print_data_summary(report, args.out, elapsed)
    return 0


def _print_data_summary(report: dict, out: str, elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    def size(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"

    table = Table(title=f"lmforge data -> {out}", title_justify="left")
    for col in ("stage", "docs in", "docs out", "removed", "bytes in", "bytes out", "top reasons"):
        table.add_column(col, justify="left" if col in ("stage", "top reasons") else "right")
    for row in report["stages"]:
        reasons = sorted(row["removed"].items(), key=lambda kv: -kv[1])[:3]
        name = row["stage"] + (f" [{','.join(row['domains'])}]" if "domains" in row else "")
        table.add_row(
            name,
            f"{row['docs_in']:,}",
            f"{row['docs_out']:,}",
            f"{row['docs_in'] - row['docs_out']:,}",
            size(row["bytes_in"]),
            size(row["bytes_out"]),
            ", ".join(f"{r.split('.', 1)[1]} {c:,}" for r, c in reasons),
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    docs = report["documents"]
    console.print(
        f"{docs['input']:,} documents in, {docs['kept']:,} kept, {docs['removed']:,} removed "
        f"({report['bad_input']['count']:,} bad input records) in {elapsed:.1f}s; "
        f"kept by domain: {', '.join(f'{d} {n:,}' for d, n in report['kept_by_domain'].items()) or 'none'}"
    )
    if "tokens" in report:
        tokens = report["tokens"]["tokens"]
        console.print(
            f"tokens ({report['tokens']['vocab_size']:,}-entry BPE): "
            + ", ".join(f"{k} {v:,}" for k, v in sorted(tokens.items()))
            + f'; train on them with data.prepared = "{out}"'
        )


def cmd_data_inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.removals import excerpt, sample_removals

    if args.chars < 1:
        raise UserError(
            f"--chars: give how many characters of each text to show, at least 1 (got {args.chars})"
        )
    found = sample_removals(args.out, args.reason, args.n)
    by_reason = ", ".join(f"{r} {c:,}" for r, c in found.counts.items())
    shown = f"the first {len(found.samples)}" if len(found.samples) < found.total else "all"
    print(f"{found.rule}: {found.total:,} documents removed in {args.out} ({by_reason}); {shown}:")
    for i, rec in enumerate(found.samples, 1):
        source = rec["source"]
        where = found.sources[source] if 0 <= source < len(found.sources) else "?"
        print(f"\n[{i}] {rec['id']}  (source {source}: {where}; domain {rec['domain']})")
        print(f"    {rec['reason']}: {_measure(rec)}")
        if found.text_kept:
            text, rest = excerpt(rec.get("text", ""), args.chars, 12)
            print("\n".join(f"    | {line}" for line in text.split("\n")) if text else "    | (empty text)")
            if rest:
                print(f"    | ... {rest:,} more characters")
    if not found.text_kept:
        print(
            "\n(the run kept no removed text: run it with --output.removed_text=true into a new --out "
            "to see the documents here)"
        )
    return 0


def _measure(rec: dict) -> str:
    """A removal record's measure in words: value against threshold, the kept copy, the input line."""
    parts = []
    if rec.get("value") is not None:
        parts.append(f"value {_shown(rec['value'])}")
    if rec.get("threshold") is not None:
        parts.append(f"threshold {_shown(rec['threshold'])}")
    if rec.get("duplicate_of") is not None:
        parts.append(f"duplicate of {rec['duplicate_of']}")
    if rec.get("file") is not None:
        parts.append(f"at {rec['file']}:{rec.get('line')}")
    return ", ".join(parts) or "no value or threshold"


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def cmd_plot_schedule(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.charts import write_schedule

    cfg = load_config(args.recipe, parse_overrides(extra))
    out = Path(args.out)
    lrs = write_schedule(cfg, out)
    print(
        f"{out} (values: {out.with_suffix('.json')}): {cfg.schedule.name}, {len(lrs)} steps, "
        f"lr {lrs[0]:.3g} at step 0, peak {max(lrs):.3g}, {lrs[-1]:.3g} at the last step"
    )
    return 0


def cmd_lr_find(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.train.lr_find import run_lr_find

    cfg = load_config(args.recipe, parse_overrides(extra))
    out = Path(args.out)
    result = run_lr_find(cfg, out)
    s = result.suggestion
    end = f"diverged at lr {result.stop_lr:.3g}" if result.stopped_early else "reached lr_find.end_lr"
    print(f"swept {len(result.lrs)} steps from {result.lrs[0]:.3g} to {result.lrs[-1]:.3g} ({end})")
    print(f"smoothed loss minimum at lr {s.min_lr:.3g} (min / 10: {s.min_over_10:.3g})")
    print(f"suggested lr (steepest descent of the smoothed loss): {s.lr:.3g}  -> --optim.lr={s.lr:.3g}")
    print(f"wrote {out / 'lr_find.png'} and {out / 'lr_find.json'}")
    return 0


def cmd_mup_check(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.train.mup_check import run_mup_check, spread

    cfg = load_config(args.recipe, parse_overrides(extra))
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise UserError(f"--widths: {args.widths!r} is not a comma-separated list of integers") from None
    out = Path(args.out)
    check = run_mup_check(cfg, widths, args.steps, out)
    print(
        f"mean |activation| after {check.steps} steps at lr {check.lr:g} "
        f"(muP base width {check.base_width}); spread = largest / smallest over widths {check.widths}"
    )
    for param in check.sizes:
        print(f"{param}:")
        for w in check.widths:
            sizes = check.sizes[param][w]
            print(f"  width {w:>5}: " + "  ".join(f"{k} {v[-1]:.3g}" for k, v in sizes.items()))
        print("  spread:      " + "  ".join(f"{k} {v:.2f}x" for k, v in spread(check, param).items()))
    print(f"wrote {out / 'mup_check.png'} and {out / 'mup_check.json'}")
    return 0


GIB = 2**30


def cmd_estimate(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.planning import EstimateRequest, run_estimate

    req = EstimateRequest(
        args.recipe,
        args.model,
        args.gpu,
        args.gpus,
        args.weights,
        args.search,
        args.top,
        args.margin,
        args.mfu,
        args.attention,
        tuple(extra),
    )
    result = run_estimate(req)
    est, found, more, hw, workload = result.estimate, result.found, result.more, result.hw, result.workload
    name, precision = result.name, result.precision
    if args.json:
        print(json.dumps(result.to_json(args.search)))
    else:
        print(_estimate_text(est, name, workload.optimizer, hw))
        if args.search:
            print(_search_text(found, args.gpus, hw, more))
        elif not est.fits:
            print("does not fit: lmforge estimate ... --search lists the layouts that do, fastest first")
    if args.plot:
        from lmforge.charts import memory_chart

        bars = [(f"asked: {est.layout.describe()}", est.rows())] + [
            (e.layout.describe(), e.rows()) for e in found
        ]
        title = f"{name} on {args.gpus} x {hw.name}, {precision}, {workload.optimizer} ({args.weights} accounting)"
        memory_chart(
            [(label.replace(", ", "\n"), rows) for label, rows in bars],
            hw.memory_bytes,
            args.margin,
            Path(args.plot),
            title,
        )
        if not args.json:
            print(f"wrote {args.plot}")
    return 0


def _estimate_text(e, name: str, optimizer: str, hw) -> str:
    t, c = e.temporaries, e.comm
    temps = ", ".join(
        f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in vars(t).items() if v and k != "optimizer_step"
    )
    acts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in e.activation_parts.items() if v)
    limit = e.margin * e.memory_bytes
    lines = [
        f"{name}: {e.n_params:,} parameters ({e.n_params / 1e9:.2f}B); {e.layout.world} x {hw.name} "
        f"({e.memory_bytes / GIB:.1f} GiB each); {e.precision}, {optimizer}, {e.attention} attention; "
        f"{e.accounting} accounting",
        f"layout: {e.layout.describe()}; {e.tokens_per_step:,} tokens per step ({e.accum} micro-batch{'es' if e.accum > 1 else ''} per rank)",
        f"per device (pipeline rank {e.pp_rank}: {e.device_params / 1e9:.2f}B parameters after TP/PP, before "
        "data-parallel sharding)        GiB",
    ]
    lines.append(f"  peak: {e.peak_phase}")
    grads_note = (
        ""
        if e.gradients_at_peak == e.states.grads
        else f"unsharded while micro-batches accumulate; {e.states.grads / GIB:.2f} GiB reduce-scattered"
        if e.gradients_at_peak > e.states.grads
        else f"{e.states.grads / GIB:.2f} GiB by the end of backward"
    )
    acts_note = (
        acts if e.activations_at_peak else f"{e.activations / GIB:.2f} GiB at the start of backward: {acts}"
    )
    for row, value in e.rows().items():
        detail = {
            "gradients": grads_note,
            "activations": acts_note,
            "temporaries": temps if e.temporaries_at_peak == t.during_backward else "",
            "overhead": f"{e.overhead_runtime / GIB:.1f} GiB runtime + {e.overhead_fraction:.0%} of the rest, assumed",
        }.get(row, "")
        lines.append(f"  {row:<18s} {value / GIB:10.2f}" + (f"   ({detail})" if detail else ""))
    if t.optimizer_step:
        lines.append(
            f"  (optimizer step scratch {t.optimizer_step / GIB:.2f} GiB, after the activations are freed)"
        )
    verdict = (
        f"{'fits' if e.fits else 'DOES NOT FIT'}: {e.peak / e.memory_bytes:.0%} of the device; limit "
        f"{e.margin:.0%} = {limit / GIB:.1f} GiB (Fujii et al. 2024: no OOM in 454 runs under 80%)"
    )
    b = e.build
    build = (
        f"initialising: FP32 parameters {b.shards / GIB:.2f}"
        + (
            f" + the largest whole parameter {b.temporary / GIB:.2f}"
            if b.temporary
            else " (each initialised in place)"
        )
        + (f" + DDP buckets {b.ddp_buckets / GIB:.2f}" if b.ddp_buckets else "")
        + f" + overhead {e.build_overhead / GIB:.2f}"
        + (f", pipeline rank {e.build_pp_rank}" if e.layout.pp > 1 else "")
    )
    step_peak = e.peak_source == "step"
    lines.append(f"  {'total':<18s} {e.total / GIB:10.2f}   " + (verdict if step_peak else "(training step)"))
    lines.append(
        f"  {'build':<18s} {e.build_total / GIB:10.2f}   ({build})" + ("" if step_peak else f"; {verdict}")
    )
    if len(e.pp_rank_totals) > 1:
        lines.append(
            "  per pipeline rank: "
            + ", ".join(f"{r}: {t / GIB:.2f}" for r, t in enumerate(e.pp_rank_totals))
            + " GiB; build "
            + ", ".join(f"{r}: {t / GIB:.2f}" for r, t in enumerate(e.pp_rank_build_totals))
            + " GiB"
        )
    lines += [
        f"compute: {e.flops_per_token / 1e9:.1f} GFLOP per token (6N + 12 L d T), {e.flops_per_step / 1e15:.2f} PFLOP "
        f"per step; recompute x{e.recompute:.2f}, pipeline bubble {e.bubble:.1%} ((p-1)/(m+p-1))",
        f"time at MFU {e.mfu:.2f}: step {e.step_s:.3f} s (compute {e.compute_s:.3f} s, exposed communication "
        f"{e.exposed_comm_s:.3f} s), {e.tokens_per_s:,.0f} tokens/s, {e.tokens_per_day / 1e9:.2f}B tokens/day",
        f"communication per step and device: data parallel {c.dp / GIB:.2f} GiB, tensor parallel {c.tp / GIB:.2f} GiB, "
        f"pipeline {c.pp / GIB:.2f} GiB",
        f"Chinchilla (D = 20 N): {e.chinchilla_tokens / 1e9:.1f}B tokens in {e.chinchilla_days:.1f} days at this rate",
    ]
    lines += [f"warning: {w}" for w in e.warnings]
    return "\n".join(lines)


def _search_text(found: list, gpus: int, hw, more=None) -> str:
    if not found:
        text = f"\nsearch: no layout of {gpus} x {hw.name} fits"
        if more is None:
            return text + " (nor on up to 4096 devices)"
        n, e = more
        return (
            f"{text}; the fewest devices (doubling) on which one does: {n} x {hw.name}, fastest: "
            f"{e.layout.describe()}, {e.total / GIB:.2f} GiB per device, {e.tokens_per_s:,.0f} tokens/s"
        )
    lines = [
        f"\nlayouts that fit on {gpus} x {hw.name}, fastest first:",
        f"  {'#':>2s}  {'layout':<42s} {'GiB':>7s} {'tokens/s':>11s} {'step s':>7s} {'days 20N':>8s}",
    ]
    for i, e in enumerate(found, 1):
        lines.append(
            f"  {i:2d}  {e.layout.describe():<42s} {e.total / GIB:7.2f} {e.tokens_per_s:11,.0f} {e.step_s:7.3f} {e.chinchilla_days:8.1f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmforge", description="Train language models from raw text.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_pipeline_commands(sub)
    _add_posttrain_commands(sub)
    _add_run_commands(sub)
    _add_probe_commands(sub)
    _add_tokenizer_commands(sub)
    return parser


def _add_tokenizer_commands(sub: argparse._SubParsersAction) -> None:
    """``tokenizers compare``: BPE, Unigram and WordPiece trained and measured on the same documents."""
    p = sub.add_parser("tokenizers", help="compare tokenizer kinds and vocabulary sizes (docs/tokenizers.md)")
    tsub = p.add_subparsers(dest="tokenizers_command", required=True)
    p = tsub.add_parser(
        "compare",
        help="train byte-level BPE, Unigram and WordPiece on the same documents and measure them",
        description="Per domain on held-out documents: fertility, bytes per token, vocabulary used, unknown "
        "or byte-fallback rate, round-trip share, training time; with --train-steps the same small model "
        "trained on each tokenizer and its held-out bits per byte. Writes OUT/compare.json and compare.png.",
    )
    p.add_argument(
        "--sources",
        nargs="+",
        default=["builtin:pystdlib"],
        help="txt/jsonl/parquet files, folders, globs, DOMAIN=PATH, or builtin:pystdlib (default)",
    )
    p.add_argument("--vocab-sizes", default="4096,16384", help="comma-separated sizes (default 4096,16384)")
    p.add_argument("--kinds", default="bpe,unigram,wordpiece", help="comma-separated: bpe,unigram,wordpiece")
    p.add_argument("--train-steps", type=int, default=0, help="train the small model N steps per tokenizer")
    p.add_argument("--out", default="tokenizers-compare", help="output folder (default: tokenizers-compare)")
    p.add_argument("--max-docs", type=int, default=None, help="use a seeded sample of this many documents")
    p.add_argument("--seed", type=int, default=0, help="held-out split, sample and model seed (default 0)")
    p.set_defaults(func=cmd_tokenizers_compare)


def cmd_tokenizers_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.data.tokenizer_compare import CompareSettings, format_table
    from lmforge.train.tokenizer_bpb import run_compare

    try:
        sizes = [int(v) for v in args.vocab_sizes.split(",") if v.strip()]
    except ValueError:
        raise UserError(
            f"--vocab-sizes: {args.vocab_sizes!r} is not a list of integers; e.g. 4096,16384"
        ) from None
    settings = CompareSettings(
        sources=args.sources,
        vocab_sizes=sizes,
        kinds=[k.strip() for k in args.kinds.split(",") if k.strip()],
        train_steps=args.train_steps,
        out=Path(args.out),
        max_docs=args.max_docs,
        seed=args.seed,
    )
    result = run_compare(settings, log.info)
    _print(format_table(result))
    _print(f"wrote {settings.out / 'compare.json'} and {settings.out / 'compare.png'}")
    return 0


def _add_pipeline_commands(sub: argparse._SubParsersAction) -> None:
    """``train`` and ``data``: the commands that produce a run folder or a corpus."""
    p = sub.add_parser(
        "train",
        help="train a model from a recipe",
        description="Train (or resume) a model. Any config key can be overridden as --SECTION.KEY=VALUE.",
        epilog="config keys (defaults shown):\n" + reference_text(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="TOML recipe (default: the built-in defaults)")
    p.add_argument("--run-dir", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "data",
        help="clean, filter and deduplicate raw files, then tokenize them",
        description="Run the pipeline of a recipe (configs/data/) into OUT: kept/ and removed/ documents, "
        "report.json and token shards (tokens/). A run started again continues where it stopped. "
        "Keys can be overridden as --SECTION.KEY=VALUE (e.g. --output.compression=none).",
        epilog="lmforge data inspect OUT --reason RULE [--n 5]: samples of what a rule removed "
        "(lmforge data inspect --help); lmforge data stdlib-pairs --out DIR: the post-training demonstration's "
        "records (lmforge data stdlib-pairs --help); lmforge data sweep --config RECIPE --out OUT: the "
        "cleaning trade-off from lenient to strict (lmforge data sweep --help); lmforge data train-classifier "
        "--positive FILES --negative FILES --out MODEL: the classifier stage's model "
        "(lmforge data train-classifier --help)",
    )
    p.add_argument("--config", required=True, help="pipeline recipe (TOML), e.g. configs/data/web.toml")
    p.add_argument("--out", required=True, help="output folder (new, or the one of a run to continue)")
    p.add_argument("--workers", type=int, default=None, help="parallel workers (default: every core)")
    p.add_argument("--executor", choices=["local", "ray"], default=None, help="default: execution.executor")
    p.add_argument("--no-tokenize", action="store_true", help="stop after the documents (no token shards)")
    p.set_defaults(func=cmd_data)


def _add_posttrain_commands(sub: argparse._SubParsersAction) -> None:
    """``sft`` and ``dpo``: post-training runs started from another run."""
    from lmforge.config import POSTTRAIN_DEFAULTS

    helps = {
        "sft": "supervised fine-tuning on instruction / chat / prompt-completion records",
        "dpo": "direct preference optimisation on prompt / chosen / rejected pairs",
    }
    for kind, text in helps.items():
        p = sub.add_parser(
            kind,
            help=text + " (docs/post-training.md)",
            description=f"{text}, from another run's checkpoint (--from) or resumed (--resume). Keys as for "
            "train: the recipe, then --SECTION.KEY=VALUE ([posttrain] records, [dpo] loss, train, optim, ...).",
            epilog=f"{kind}'s own defaults (under the recipe and flags): "
            + ", ".join(f"{k}={v}" for k, v in POSTTRAIN_DEFAULTS[kind].items())
            + "; model.* and data.seq_len come from --from",
        )
        p.add_argument("recipe", nargs="?", metavar="RECIPE", help="TOML recipe (optional)")
        p.add_argument("--from", dest="from_run", metavar="RUN", help="run folder to start from")
        p.add_argument("--step", type=int, help="checkpoint step of --from (default: the newest)")
        p.add_argument("--run-dir", help=f"the new run folder (default: runs/{kind}-<timestamp>)")
        p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
        p.add_argument(
            "--prepare-only",
            action="store_true",
            help="write the run folder and its step-0 checkpoint, no steps",
        )
        p.set_defaults(func=cmd_posttrain)


def build_inspect_parser() -> argparse.ArgumentParser:
    """``lmforge data inspect``: parsed on its own (``lmforge data`` takes free ``--KEY VALUE`` overrides,
    which a sub-command under it would mistake for its name)."""
    p = argparse.ArgumentParser(
        prog="lmforge data inspect",
        description="Show what a rule removed in a finished `lmforge data` run: how many documents, and the "
        "first N with the value the rule measured, its threshold and (with output.removed_text = true) "
        "the start of the text.",
    )
    p.add_argument("out", metavar="OUT", help="the --out folder of a finished lmforge data run")
    p.add_argument(
        "--reason",
        required=True,
        metavar="RULE",
        help="a removal reason (c4.too_few_sentences) or a prefix of reasons (c4: every c4.* rule)",
    )
    p.add_argument("--n", type=int, default=5, help="how many removed documents to show (default 5)")
    p.add_argument("--chars", type=int, default=600, help="characters of each text to show (default 600)")
    p.set_defaults(func=cmd_data_inspect, command="data inspect")
    return p


def build_stdlib_pairs_parser() -> argparse.ArgumentParser:
    """``lmforge data stdlib-pairs``: parsed on its own, as ``data inspect``."""
    from lmforge.posttrain.stdlib_pairs import DEFAULT_MAX_LEN_CHARS, DEFAULT_VAL_FRACTION

    p = argparse.ArgumentParser(
        prog="lmforge data stdlib-pairs",
        description="The post-training demonstration's records: questions about the standard library's "
        "modules, classes, functions and methods answered by their docstrings (SFT and DPO JSONL, whole "
        "modules held out for validation, stats.json).",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--max-len-chars",
        type=int,
        default=DEFAULT_MAX_LEN_CHARS,
        help=f"skip objects whose question + answer is longer (default {DEFAULT_MAX_LEN_CHARS})",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        help=f"share of modules held out, by seeded hash of the name (default {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument("--seed", type=int, default=0, help="split, phrasing and rejected answers (default 0)")
    p.set_defaults(func=cmd_data_stdlib_pairs, command="data stdlib-pairs")
    return p


def cmd_data_stdlib_pairs(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.posttrain.stdlib_pairs import stdlib_pairs

    stats = stdlib_pairs(args.out, args.seed, args.val_fraction, args.max_len_chars)
    splits, objects = stats["splits"], stats["objects"]
    print(
        f"{objects['found']:,} objects in {stats['files']:,} files: {objects['kept']:,} kept, skipped "
        + ", ".join(f"{r} {n:,}" for r, n in objects["skipped"].items())
    )
    for name, split in splits.items():
        kinds = ", ".join(f"{k} {n:,}" for k, n in split["by_kind"].items())
        print(
            f"{name}: {split['sft']:,} SFT records and DPO pairs from {split['modules']:,} modules ({kinds})"
        )
    print(f"wrote sft_*.jsonl, dpo_*.jsonl and stats.json to {args.out}")
    return 0


def build_sweep_parser() -> argparse.ArgumentParser:
    """``lmforge data sweep``: parsed on its own, as ``data inspect``."""
    p = argparse.ArgumentParser(
        prog="lmforge data sweep",
        description="The cleaning trade-off: run a recipe's filtering stages from lenient (level 0: no "
        "filtering) to strict (100: the strictest documented thresholds) and measure, per level, the size "
        "kept, the mean quality score under a fixed reference and the diversity of the kept text. Writes "
        "OUT/level-*/ (each a lmforge data run), OUT/sweep.json and OUT/sweep.png (docs/data.md).",
    )
    p.add_argument("--config", required=True, help="pipeline recipe (TOML), e.g. configs/data/web-model.toml")
    p.add_argument("--out", required=True, help="output folder (new, or a sweep to continue)")
    p.add_argument(
        "--levels", default="0,20,40,60,80,100", help="strictness levels 0..100 (default 0,20,...,100)"
    )
    p.add_argument("--reference-classifier", metavar="MODEL", help="score quality with this classifier model")
    p.add_argument(
        "--reference-run", metavar="RUN", help="score quality by perplexity under this run's model"
    )
    p.add_argument(
        "--reference-tokens",
        type=int,
        default=512,
        help="--reference-run scores each document's first N tokens (default 512)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json counting tokens (default: see docs/data.md)")
    p.add_argument(
        "--ngram", type=int, default=2, help="word n-gram size of the diversity measure (default 2)"
    )
    p.add_argument("--workers", type=int, default=None, help="parallel workers (default: every core)")
    p.add_argument("--seed", type=int, default=0, help="order of the fixed-size diversity sample (default 0)")
    p.set_defaults(func=cmd_data_sweep, command="data sweep")
    return p


def cmd_data_sweep(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.cleaning_sweep import parse_levels, pick_reference, run_sweep, sweep_table
    from lmforge.corpus.config import load_pipeline_config

    cfg = load_pipeline_config(args.config)
    levels = parse_levels(args.levels)
    if args.tokenizer and not Path(args.tokenizer).is_file():
        raise ConfigError(
            f"--tokenizer: {args.tokenizer} does not exist; give a tokenizer.json or leave it out"
        )
    ref = pick_reference(cfg, args.reference_classifier, args.reference_run)
    result = run_sweep(
        cfg, args.out, levels, ref, args.tokenizer, args.ngram, args.workers,
        seed=args.seed, reference_tokens=args.reference_tokens,
    )  # fmt: skip
    print(sweep_table(result))
    print(f"wrote {args.out}/sweep.json and {args.out}/sweep.png")
    return 0


def build_train_classifier_parser() -> argparse.ArgumentParser:
    """``lmforge data train-classifier``: parsed on its own, as ``data inspect``."""
    from lmforge.corpus.train_classifier import add_arguments

    p = argparse.ArgumentParser(
        prog="lmforge data train-classifier",
        description="Train the classifier stage's model: logistic regression on hashed word and character "
        "n-grams, P(positive) per document. Prints held-out accuracy; writes MODEL and its .report.json.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_data_train_classifier, command="data train-classifier")
    return p


def cmd_data_train_classifier(args: argparse.Namespace, extra: list[str]) -> int:
    from lmforge.corpus.train_classifier import summary, train_classifier

    report = train_classifier(
        args.positive, args.negative, args.out, text_field=args.text_field, max_docs=args.max_docs,
        held_out=args.held_out, c=args.c, seed=args.seed,
    )  # fmt: skip
    print("\n".join(summary(report)))
    return 0


def _is_data_inspect(argv: list[str]) -> bool:
    """``argv`` is ``[-v] data inspect ...``."""
    at = next((i for i, a in enumerate(argv) if a not in ("-v", "--verbose")), len(argv))
    return argv[at : at + 2] == ["data", "inspect"]


def _is_data_command(argv: list[str], name: str) -> bool:
    """``argv`` is ``[-v] data NAME ...``."""
    at = next((i for i, a in enumerate(argv) if a not in ("-v", "--verbose")), len(argv))
    return argv[at : at + 2] == ["data", name]


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """``eval``, ``plot``, ``compare`` and ``generate``: the commands that read run folders."""
    p = sub.add_parser("eval", help="validation loss and perplexity of a run's newest checkpoint")
    p.add_argument("run", help="run folder")
    p.add_argument(
        "--tokens", type=int, default=0, help="validation tokens to score (default: train.eval_tokens)"
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="score these .txt / .jsonl / .parquet files instead of the validation split",
    )
    p.add_argument("--text-field", default="text", help="with --data: JSON key / parquet column of the text")
    p.add_argument("--json", action="store_true", help="with --data: one JSON object instead of the table")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "plot",
        help="PNG dashboard of one or several runs (loss, lr, norms, throughput...)",
        description="Draw the metrics of runs (overlaid, one colour per run): OUT/dashboard.png with every "
        "panel some run has data for, and OUT/<panel>.png for each. Default OUT: RUN/plots for one run, "
        "./plots for several.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--out", help="output folder (default: RUN/plots, or ./plots for several runs)")
    p.add_argument("--dashboard-only", action="store_true", help="write dashboard.png only")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser(
        "compare",
        help="runs side by side: losses, tokens, time, and the config keys that differ",
        description="Per run: status, steps, final and best validation loss, tokens seen, wall time, mean "
        "tokens/s, parameters; then every config key whose value differs between the runs.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser(
        "dashboard",
        help="local web app: live training dashboard and interactive planners (docs/visual-tools.md)",
        description="Serve RUNS_DIR read-only on a local address: the runs with live curves, events, overlays "
        "and config differences, and the planners (memory, checkpointing, ZeRO, parallelism, schedules, "
        "optimizers, cleaning trade-off), every figure computed by lmforge's own code.",
    )
    p.add_argument(
        "runs_dir", nargs="?", default="runs", metavar="RUNS_DIR", help="runs folder (default: runs)"
    )
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--poll-ms", type=int, default=1000, help="how often pages poll running runs (ms)")
    p.set_defaults(func=cmd_dashboard)

    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run", help="run folder")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass; 1 disables")
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder")
    p.add_argument("run", help="run folder")
    p.add_argument("--out", help="output folder (default: RUN/hf)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "import",
        help="a Hugging Face Llama / GPT-2 folder as a run folder",
        description="Make a run folder of a local LlamaForCausalLM / GPT2LMHeadModel folder; other keys "
        "(data, train) from --config and --SECTION.KEY=VALUE as for train.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json, *.safetensors, tokenizer.json")
    p.add_argument("--run-dir", required=True, help="the new run folder")
    p.add_argument("--config", help="TOML recipe for the data and training keys")
    p.set_defaults(func=cmd_import)


def _add_probe_commands(sub: argparse._SubParsersAction) -> None:
    """``plot-schedule``, ``lr-find`` and ``mup-check``: short probes of a recipe before a run."""
    recipe_help = "TOML recipe (default: the built-in defaults); then --SECTION.KEY=VALUE overrides"
    p = sub.add_parser(
        "plot-schedule",
        help="plot a recipe's learning rate over the run",
        description="Draw the learning rate of every step (PNG) and write the values beside it (JSON).",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--out", default="schedule.png", help="PNG file (values go to the same name .json)")
    p.set_defaults(func=cmd_plot_schedule)

    p = sub.add_parser(
        "lr-find",
        help="learning-rate sweep: plot and suggestion",
        description="Train lr_find.steps steps at geometrically growing learning rates (lr_find.start_lr "
        "to lr_find.end_lr), smooth the loss, stop on divergence, suggest the rate where the smoothed "
        "loss falls fastest. Writes only DIR/lr_find.png and DIR/lr_find.json.",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--out", default="lr_find", help="output folder (default: lr_find)")
    p.set_defaults(func=cmd_lr_find)

    p = sub.add_parser(
        "mup-check",
        help="muP coordinate check: activation size against width, muP and standard",
        description="Train a few steps at several widths under the standard parametrisation and under muP "
        "and record the mean |activation| per layer. Use a small depth and short sequences "
        "(e.g. --model.n_layers=2 --data.seq_len=64).",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument("--widths", default="64,128,256,512", help="comma-separated d_model values")
    p.add_argument("--steps", type=int, default=10, help="training steps per model")
    p.add_argument("--out", default="mup_check", help="output folder (default: mup_check)")
    p.set_defaults(func=cmd_mup_check)

    p = sub.add_parser(
        "estimate",
        help="memory, time and communication of a layout before running it",
        description="Per device: parameters, gradients, optimizer states, master weights, activations, "
        "temporary buffers and overhead, whether that fits under --margin of the device's memory; FLOPs, "
        "step time at --mfu, tokens/day, communication, pipeline bubble, days to Chinchilla's 20 N tokens. "
        "Formulas: lmforge/plan/ and docs/memory.md.",
    )
    p.add_argument("recipe", nargs="?", help=recipe_help)
    p.add_argument(
        "--model",
        help="a named size (its model, vocab and seq_len under the overrides): "
        "gpt2-124m, llama-1b, llama-7b, llama-13b, llama-65b, llama-70b, gpt3-175b",
    )
    p.add_argument("--gpu", default="h100-80gb", help="h100-80gb, h200, a100-80gb, a100-40gb or cpu")
    p.add_argument("--gpus", type=int, default=1, help="devices (with every parallel degree 1: all shard)")
    p.add_argument(
        "--weights",
        choices=["lmforge", "zero-paper"],
        default="lmforge",
        help="accounting: lmforge (FP32 params = master, FP32 grads) or zero-paper (2+2+4+K)",
    )
    p.add_argument("--search", action="store_true", help="also list the layouts that fit, fastest first")
    p.add_argument("--top", type=int, default=10, help="layouts --search lists (default 10)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--plot", metavar="PNG", help="stacked bar chart of the breakdown (one bar per layout)")
    p.add_argument("--margin", type=float, default=0.8, help="fits below this share of memory (0.8)")
    p.add_argument("--mfu", type=float, default=0.4, help="model-FLOPs utilisation assumed (0.4)")
    p.add_argument(
        "--attention",
        choices=["flash", "flex", "math"],
        default=None,
        help="what attention saves: flash / flex O(T), math T x T (default: what train.attention picks there)",
    )
    p.set_defaults(func=cmd_estimate)


TAKES_OVERRIDES = {
    "train",
    "data",
    "import",
    "sft",
    "dpo",
    "plot-schedule",
    "lr-find",
    "mup-check",
    "estimate",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _is_data_inspect(argv):
        at = argv.index("data")
        args, extra = build_inspect_parser().parse_args(argv[at + 2 :]), []
        args.verbose = at > 0
    elif _is_data_command(argv, "stdlib-pairs"):
        at = argv.index("data")
        args, extra = build_stdlib_pairs_parser().parse_args(argv[at + 2 :]), []
        args.verbose = at > 0
    elif _is_data_command(argv, "sweep"):
        at = argv.index("data")
        args, extra = build_sweep_parser().parse_args(argv[at + 2 :]), []
        args.verbose = at > 0
    elif _is_data_command(argv, "train-classifier"):
        at = argv.index("data")
        args, extra = build_train_classifier_parser().parse_args(argv[at + 2 :]), []
        args.verbose = at > 0
    else:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and args.command not in TAKES_OVERRIDES:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.verbose)
    try:
        code = args.func(args, extra)
    except UserError as exc:
        if _rank() == 0:  # every rank meets the same error in the same config; one line is enough
            print(f"lmforge {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Interrupted as exc:
        print(f"interrupted ({signal.Signals(exc.signal).name} twice): exited at once", file=sys.stderr)
        code = 128 + int(exc.signal)
    sys.exit(code)
