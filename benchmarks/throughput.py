"""Training throughput and MFU of lmforge against Hugging Face ``transformers`` on the same shape.

Both sides train a Llama-style model of the recipe's shape on the same random token batches, with the
same precision, batch and AdamW settings: lmforge through its own ``train_step`` (with the recipe's
compile setting), the baseline as ``LlamaForCausalLM`` (SDPA attention) in a plain PyTorch loop
(forward with ``labels``, backward, clip, step). Rounds alternate between the two and the medians of
the per-step times are compared, so drift in machine speed hits both alike.

MFU uses ``flops_per_token = 6 N + 12 L d T`` (see ``lmforge.plan.flops``) against the peak matmul
throughput measured here on the same device and precision.

    python benchmarks/throughput.py [--config RECIPE.toml] [--SECTION.KEY=VALUE ...] [--rounds 5]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from lmforge.train.loop import maybe_compile, train_step

from lmforge.data.loader import Batch
from lmforge.model.transformer import Transformer, ff_width
from lmforge.optim.build import build_optimizer
from lmforge.plan.flops import flops_per_token, mfu
from lmforge.precision import autocast, resolve_precision
from lmforge.recipe import load_config, parse_overrides
from lmforge.train.runtime import pick_device


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
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and side")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side (compilation)")
    ap.add_argument(
        "--doc-mask", action="store_true", help="lmforge with document masking (baseline has none)"
    )
    args, extra = ap.parse_known_args()
    cfg = load_config(args.config, parse_overrides(extra))
    if cfg.model.arch != "llama":
        raise SystemExit("model.arch: the baseline is LlamaForCausalLM; benchmark a llama recipe")
    device = pick_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    vocab, seq, mbs = args.vocab_size or cfg.data.vocab_size, cfg.data.seq_len, cfg.train.micro_batch_size

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (8, mbs, seq + 1), generator=g)
    docs = torch.cumsum(torch.rand(8, mbs, seq, generator=g) < 1 / 512, dim=-1)
    batches = [
        Batch(d[:, :-1], d[:, 1:], doc if args.doc_mask else torch.zeros_like(doc))
        for d, doc in zip(data, docs, strict=True)
    ]
    if not args.doc_mask:
        cfg.model.doc_mask = False

    torch.manual_seed(0)
    ours = Transformer(cfg.model, vocab, seq, cfg.train.attention, cfg.train.loss_chunk).to(device)
    ours_opt = build_optimizer(ours, cfg.optim, device)
    maybe_compile(ours, cfg.train.compile, device)
    theirs = hf_model(cfg, vocab, seq, device)
    theirs_opt = torch.optim.AdamW(
        theirs.parameters(),
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        weight_decay=cfg.optim.weight_decay,
        fused=True,
    )
    i = {"ours": 0, "theirs": 0}

    def ours_step() -> None:
        b = batches[i["ours"] % len(batches)]
        i["ours"] += 1
        train_step(ours, ours_opt, [b], cfg.optim.lr, cfg.train.grad_clip, precision, device)

    def theirs_step() -> None:
        d = data[i["theirs"] % len(data)].to(device)
        i["theirs"] += 1
        with autocast(precision, device):
            loss = theirs(input_ids=d[:, :-1], labels=d[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), cfg.train.grad_clip)
        theirs_opt.step()
        theirs_opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    time_steps(ours_step, args.warmup, device)
    compile_s = time.perf_counter() - t0
    time_steps(theirs_step, args.warmup, device)
    ours_t: list[float] = []
    theirs_t: list[float] = []
    for r in range(args.rounds):
        ours_t += time_steps(ours_step, args.steps, device)
        theirs_t += time_steps(theirs_step, args.steps, device)
        print(
            f"round {r + 1}/{args.rounds}: lmforge {mbs * seq / statistics.median(ours_t):,.0f} tok/s, "
            f"transformers {mbs * seq / statistics.median(theirs_t):,.0f} tok/s",
            flush=True,
        )
    tps = mbs * seq / statistics.median(ours_t)
    base_tps = mbs * seq / statistics.median(theirs_t)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak = peak_matmul_flops(dtype, device)
    fpt = flops_per_token(ours.num_params(), cfg.model.n_layers, cfg.model.d_model, seq)
    result = {
        "tokens_per_s": round(tps, 1),
        "mfu": round(mfu(tps, fpt, peak), 4),
        "baseline_tokens_per_s": round(base_tps, 1),
        "baseline_mfu": round(mfu(base_tps, fpt, peak), 4),
        "speedup": round(tps / base_tps, 3),
        "peak_matmul_tflops": round(peak / 1e12, 4),
        "flops_per_token": fpt,
        "params": ours.num_params(False),
        "precision": precision,
        "device": device.type,
        "compile": cfg.train.compile,
        "compile_warmup_s": round(compile_s, 1),
        "doc_mask": args.doc_mask,
        "batch": [mbs, seq],
    }
    print(
        f"lmforge {tps:,.0f} tok/s (MFU {result['mfu']:.1%}) vs transformers {base_tps:,.0f} tok/s: {tps / base_tps:.2f}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
