"""Greedy generation speed: lmforge with its key/value cache, lmforge without it, and transformers'
``generate`` on the same weights exported to Hugging Face's Llama class.

One model (the built-in default's shape unless overridden: ``--SECTION.KEY=VALUE`` model flags), its
weights drawn from ``--seed``, FP32 on the CPU, ``torch.set_num_threads(--threads)`` for all three. The
same ``--batch`` prompts of ``--prompt-len`` random tokens each (one length: no padding, so the three
compute the same positions), ``--new-tokens`` greedy tokens each, no stop token. Each way runs once to warm
up, then ``--repeats`` times; the median wall time is reported as generated tokens per second, with the
ratios against transformers measured in the same run. The three outputs are compared token for token.

    python benchmarks/generation.py [--batch 1] [--prompt-len 64] [--new-tokens 128] [--threads 2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lmforge.hf import llama
from lmforge.model.sampling import generate_batch
from lmforge.model.transformer import Transformer
from lmforge.recipe import load_config, parse_overrides


def hf_model(model: Transformer):
    """transformers' ``LlamaForCausalLM`` holding ``model``'s weights (lmforge's export map)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = llama.config_to_hf(model.cfg, model.vocab_size, model.max_seq_len, 0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}
    missing, unexpected = hf.load_state_dict(llama.state_to_hf(state, model.cfg), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"weights did not map: missing {missing}, unexpected {unexpected}")
    if model.cfg.tie_embeddings:
        hf.tie_weights()
    return hf


def timed(fn, repeats: int) -> tuple[float, list[list[int]]]:
    """The median wall time of ``repeats`` calls of ``fn`` after one warm-up call, and its output."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args, extra = ap.parse_known_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(None, parse_overrides(extra))
    if cfg.model.arch != "llama" or cfg.model.moe.experts:
        raise SystemExit(
            "--model.arch: this benchmark compares against transformers' Llama; use llama, dense"
        )
    if args.prompt_len + args.new_tokens > cfg.data.seq_len:
        raise SystemExit(
            f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) exceed data.seq_len "
            f"({cfg.data.seq_len}); lower them or raise --data.seq_len"
        )
    torch.manual_seed(args.seed)
    model = Transformer(cfg.model, cfg.data.vocab_size, cfg.data.seq_len)
    model.init_weights()
    model.eval()
    hf = hf_model(model)
    prompts = torch.randint(
        0, cfg.data.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator()
    )
    rows = prompts.tolist()
    n = args.new_tokens

    def transformers_generate() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                prompts,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, args.prompt_len :].tolist()

    ways = {
        "lmforge_cache": lambda: generate_batch(model, rows, n, temperature=0),
        "lmforge_no_cache": lambda: generate_batch(model, rows, n, temperature=0, use_cache=False),
        "transformers": transformers_generate,
    }
    results, outputs = {}, {}
    for name, fn in ways.items():
        wall, outputs[name] = timed(fn, args.repeats)
        results[name] = args.batch * n / wall
        print(f"{name:17s}: {results[name]:8.1f} generated tokens/s (median of {args.repeats}, {wall:.2f} s)")
    for name in ("lmforge_cache", "lmforge_no_cache"):
        print(f"{name} / transformers: {results[name] / results['transformers']:.2f}x")
    print(f"cache / no cache: {results['lmforge_cache'] / results['lmforge_no_cache']:.2f}x")
    same = {name: outputs[name] == outputs["transformers"] for name in ("lmforge_cache", "lmforge_no_cache")}
    print(f"greedy tokens equal to transformers': {same}")
    params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps(
            {
                "batch": args.batch,
                "prompt_len": args.prompt_len,
                "new_tokens": n,
                "threads": args.threads,
                "parameters": params,
                "tokens_per_s": results,
                "equal_to_transformers": same,
            }
        )
    )


if __name__ == "__main__":
    main()
