"""What fake quantization costs a training step: forward and backward of one model with QAT's quantizers
on and off, alternated in one process, so both see the same machine and load.

The model is ``configs/experiment-small.toml``'s unless overridden (``--SECTION.KEY=VALUE``), the batch
``train.micro_batch_size x data.seq_len`` random tokens of a 4096-token vocabulary. Each repetition times
one forward + backward with the quantizers on and one with them off (order alternating); printed: the
median of each and their ratio. The last line printed is one JSON object.

    python benchmarks/qat_step_cost.py [--scheme int8da-int4w] [--group-size 32] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lmforge.model.loss import NextTokenLoss
from lmforge.model.qat import apply_qat, set_fake_quant
from lmforge.model.transformer import Transformer
from lmforge.recipe import load_config, parse_overrides

RECIPE = Path(__file__).resolve().parent.parent / "configs" / "experiment-small.toml"
VOCAB = 4096


def step_seconds(objective: NextTokenLoss, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Wall seconds of one forward and backward of ``objective``."""
    start = time.perf_counter()
    loss, _ = objective(inputs, targets)
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", default="int8da-int4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    args, extra = ap.parse_known_args()
    cfg = load_config(RECIPE, parse_overrides(extra))
    torch.manual_seed(0)
    model = Transformer(cfg.model, VOCAB, cfg.data.seq_len)
    model.init_weights()
    layers = apply_qat(model, args.scheme, args.group_size)
    objective = NextTokenLoss(model)
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len)
    inputs, targets = torch.randint(0, VOCAB, shape), torch.randint(0, VOCAB, shape)
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(args.reps + 2):  # the first two repetitions warm up
        for on in (True, False) if rep % 2 else (False, True):
            set_fake_quant(model, on)
            seconds = step_seconds(objective, inputs, targets)
            if rep >= 2:
                times[on].append(seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{len(layers)} layers fake-quantized ({args.scheme}, group {args.group_size})")
    print(
        f"forward + backward: {on * 1e3:.1f} ms with fake quantization, {off * 1e3:.1f} ms without: {on / off:.2f}x"
    )
    print(json.dumps({"scheme": args.scheme, "on_s": on, "off_s": off, "ratio": on / off, "reps": args.reps}))


if __name__ == "__main__":
    main()
