"""Differential checkpoints (``train.checkpoint_full_every``): bytes on disk of each checkpoint, full against
differential, under full AdamW training and under LoRA (the base frozen), one process.

Each case trains the same small Llama-style model on the built-in corpus through ``lmforge train``'s own
loop, checkpointing every ``--interval`` steps with one full checkpoint in ``--full-every`` (all kept),
then reads the sizes of the checkpoint folders (every file: DCP data, trainer state, RNG, manifest) and
checks that each differential checkpoint restores bitwise what its step's state was (loaded whole and
compared with a full save of the same run's state written by a second run with ``checkpoint_full_every =
1``: same seed, same batches). Printed: per case the bytes of each checkpoint and the differential/full
ratio, then one JSON object.

    python benchmarks/differential_checkpoints.py [--steps 40] [--interval 10] [--full-every 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch

from lmforge.recipe import load_config, parse_overrides
from lmforge.train.checkpoint import list_checkpoints, load_checkpoint, read_differential
from lmforge.train.launch import train

CASES = {
    "adamw_full_training": {},
    "lora_rank8_frozen_base": {"lora.rank": 8, "lora.targets": "all-linear"},
}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def same_bits(a: dict, b: dict) -> bool:
    for part in ("model", "optimizer"):
        if set(a[part]) != set(b[part]):
            return False
        for key, value in a[part].items():
            other = b[part][key]
            if isinstance(value, torch.Tensor):
                bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
                if value.dtype != other.dtype or not torch.equal(bits(value), bits(other)):
                    return False
            elif value != other:
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--full-every", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--cache-dir", default="data", help="prepared-data cache (shared with lmforge train)")
    args, extra = ap.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    base = {
        "data.cache_dir": args.cache_dir,
        "data.vocab_size": 1024,
        "data.seq_len": 64,
        "model.d_model": args.d_model,
        "model.n_layers": args.n_layers,
        "model.n_heads": 4,
        "train.steps": args.steps,
        "train.micro_batch_size": 8,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": 0,
        "train.eval_tokens": 4096,
        "train.checkpoint_interval": args.interval,
        "train.keep_checkpoints": 1000,
        "train.sample_tokens": 0,
        **parse_overrides(extra),
    }
    root = Path(tempfile.mkdtemp(prefix="lmforge-diffckpt-"))
    out: dict = {"steps": args.steps, "interval": args.interval, "full_every": args.full_every, "cases": {}}
    for name, keys in CASES.items():
        diff_run, full_run = root / name / "differential", root / name / "full"
        train(
            load_config(None, {**base, **keys, "train.checkpoint_full_every": args.full_every}),
            diff_run,
            progress_bar=False,
        )
        train(load_config(None, {**base, **keys}), full_run, progress_bar=False)
        rows = []
        for folder in list_checkpoints(diff_run):
            record = read_differential(folder)
            twin = full_run / "checkpoints" / folder.name
            rows.append(
                {
                    "step": folder.name,
                    "kind": "full" if record is None else "differential",
                    "bytes": folder_bytes(folder),
                    "full_bytes": folder_bytes(twin),
                    "bitwise_equal_to_full_save": same_bits(load_checkpoint(folder), load_checkpoint(twin)),
                }
            )
        diffs = [r for r in rows if r["kind"] == "differential"]
        ratio = sum(r["bytes"] for r in diffs) / sum(r["full_bytes"] for r in diffs) if diffs else None
        out["cases"][name] = {"checkpoints": rows, "differential_over_full": ratio}
        for r in rows:
            print(
                f"{name:24s} {r['step']} {r['kind']:12s} {r['bytes']:>10d} bytes (full save {r['full_bytes']:>10d}) "
                f"bitwise {r['bitwise_equal_to_full_save']}"
            )
        print(f"{name:24s} differential / full: {ratio:.3f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
