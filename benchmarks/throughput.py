"""Training throughput and MFU of lmforge against Hugging Face ``transformers`` on the same shape.

Both sides train a Llama-style model of the recipe's shape on the same random token batches with the
same treatment: the same precision (the recipe's policy: BF16 autocast over FP32 master weights, or
FP32), batch, sequence length and AdamW settings (fused where lmforge fuses), global-norm clipping, no
document mask. lmforge is built by its build path (``lmforge.train.build``) and runs its own ``train_step``; the baseline is ``LlamaForCausalLM`` (SDPA
attention, no KV cache) in a plain loop: forward, cross-entropy over the same targets in FP32 (as
``transformers`` computes its loss: full logits upcast), backward, clip, step.

Four variants are measured: lmforge and the baseline, each compiled and eager. Compiled means the
whole training objective (forward, output head, loss) through ``lmforge.parallel.apply.compile_like_training``,
with identical ``torch.compile`` settings on both sides. With ``--train.compile=false`` (or where the
platform cannot compile) only the eager pair runs. Each round runs every variant for ``--steps`` steps,
the order rotating from round to round; medians of the per-step times are compared, so drift in
machine speed hits all alike.

MFU uses ``flops_per_token = 6 N + 12 L d T`` (see ``lmforge.plan.flops``) against the peak matmul
throughput measured here on the same device and precision.

    python benchmarks/throughput.py [--config RECIPE.toml] [--SECTION.KEY=VALUE ...] [--rounds 5]

The last line printed is one JSON object: ``tokens_per_s``/``mfu`` (lmforge, compiled if compiling),
``baseline_tokens_per_s``/``baseline_mfu`` (the baseline in the same mode), ``eager_tokens_per_s`` and
``baseline_eager_tokens_per_s``, ``speedup_compiled`` (null without compilation) and ``speedup_eager``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from lmforge.data.loader import Batch
from lmforge.model.transformer import ff_width
from lmforge.optim.build import build_optimizer
from lmforge.optim.clip import Clipper
from lmforge.parallel.apply import can_compile, compile_like_training
from lmforge.plan.flops import flops_per_token, mfu
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.build import training_module
from lmforge.train.runtime import pick_device
from lmforge.train.step import train_step


def peak_matmul_flops(
    dtype: torch.dtype, device: torch.device, n: int = 1024, budget_s: float = 3.0
) -> float:
    """Best observed FLOP/s of an n x n x n matrix product (2 n^3 FLOPs), repeated for ``budget_s``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best, start, reps = 0.0, time.perf_counter(), 0
    while reps < 3 or (time.perf_counter() - start < budget_s and reps < 50):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
        reps += 1
    return best


def hf_model(cfg, vocab: int, seq_len: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    hf_cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=m.d_model,
        intermediate_size=ff_width(m),
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads or m.n_heads,
        max_position_embeddings=seq_len,
        rms_norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_cfg).to(device)


def time_steps(step_fn, n: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step_fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--vocab-size", type=int, default=0, help="default: data.vocab_size")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over all variants")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and variant")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (default: torch's); 1 is steadier where other jobs share the cores",
    )
    args, extra = ap.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.config, parse_overrides(extra))
    if cfg.model.arch != "llama":
        raise SystemExit("model.arch: the baseline is LlamaForCausalLM; benchmark a llama recipe")
    device = pick_device(cfg.train.device)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    vocab, seq, mbs = args.vocab_size or cfg.data.vocab_size, cfg.data.seq_len, cfg.train.micro_batch_size
    cfg.model.doc_mask = False  # the baseline has none
    compiled = can_compile(cfg.train.compile, device)

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (8, mbs, seq + 1), generator=g)
    no_docs = torch.zeros(mbs, seq, dtype=torch.long)
    batches = [Batch(d[:, :-1], d[:, 1:], no_docs) for d in data]

    def ours(compile_it: bool):
        run_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"compile": compile_it})})
        module = training_module(run_cfg, vocab, device, compute_dtype=precision.compute_dtype)
        model = module.model
        opt = build_optimizer(model, cfg.optim, device)
        clipper = Clipper("norm", cfg.train.grad_clip)
        i = 0

        def step() -> None:
            nonlocal i
            b = batches[i % len(batches)]
            i += 1
            train_step(module, opt, [b], cfg.optim.lr, clipper, precision)

        return model, step

    def theirs(compile_it: bool):
        model = hf_model(cfg, vocab, seq, device).train()
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optim.lr,
            betas=cfg.optim.betas,
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
            fused=cfg.optim.fused if cfg.optim.fused is not None else device.type in ("cuda", "cpu"),
        )

        def objective(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x, use_cache=False).logits
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)

        loss_fn = compile_like_training(objective) if compile_it else objective
        i = 0

        def step() -> None:
            nonlocal i
            d = data[i % len(data)].to(device)
            i += 1
            with precision.autocast():
                loss = loss_fn(d[:, :-1], d[:, 1:])
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, step

    variants = {}  # name -> step function, in first-round order
    warmup_s = {}
    for name, make, compile_it in [
        ("lmforge compiled", ours, True),
        ("transformers compiled", theirs, True),
        ("lmforge eager", ours, False),
        ("transformers eager", theirs, False),
    ]:
        if compile_it and not compiled:
            continue
        model, step = make(compile_it)
        if name.startswith("lmforge"):
            ours_model = model
        t0 = time.perf_counter()
        time_steps(step, args.warmup, device)
        warmup_s[name] = time.perf_counter() - t0
        variants[name] = step
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name] += time_steps(variants[name], args.steps, device)
        tps = {name: mbs * seq / statistics.median(t) for name, t in times.items()}
        line = ", ".join(f"{n} {v:,.0f}" for n, v in tps.items())
        print(f"round {r + 1}/{args.rounds} (tok/s, medians so far): {line}", flush=True)
    tps = {name: mbs * seq / statistics.median(t) for name, t in times.items()}
    mode = "compiled" if compiled else "eager"
    ours_tps, base_tps = tps[f"lmforge {mode}"], tps[f"transformers {mode}"]
    peak = peak_matmul_flops(precision.compute_dtype, device)
    fpt = flops_per_token(ours_model.num_params(), cfg.model.n_layers, cfg.model.d_model, seq)
    speedup_compiled = round(tps["lmforge compiled"] / tps["transformers compiled"], 3) if compiled else None
    speedup_eager = round(tps["lmforge eager"] / tps["transformers eager"], 3)
    result = {
        "tokens_per_s": round(ours_tps, 1),
        "mfu": round(mfu(ours_tps, fpt, peak), 4),
        "baseline_tokens_per_s": round(base_tps, 1),
        "baseline_mfu": round(mfu(base_tps, fpt, peak), 4),
        "speedup_compiled": speedup_compiled,
        "speedup_eager": speedup_eager,
        "speedup": round(ours_tps / base_tps, 3),
        "eager_tokens_per_s": round(tps["lmforge eager"], 1),
        "baseline_eager_tokens_per_s": round(tps["transformers eager"], 1),
        "peak_matmul_tflops": round(peak / 1e12, 4),
        "flops_per_token": fpt,
        "params": ours_model.num_params(False),
        "precision": precision.name,
        "device": device.type,
        "compile": compiled,
        "compile_warmup_s": round(warmup_s["lmforge compiled"], 1) if compiled else None,
        "doc_mask": False,
        "batch": [mbs, seq],
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "threads": torch.get_num_threads(),
    }
    if compiled:
        print(
            f"compiled: lmforge {tps['lmforge compiled']:,.0f} tok/s (MFU {result['mfu']:.1%}) vs "
            f"transformers {tps['transformers compiled']:,.0f} tok/s: {speedup_compiled:.2f}x"
        )
    print(
        f"eager: lmforge {tps['lmforge eager']:,.0f} tok/s vs transformers "
        f"{tps['transformers eager']:,.0f} tok/s: {speedup_eager:.2f}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
