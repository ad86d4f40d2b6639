"""Worker: DDP gradient compression (``parallel.ddp_comm_hook``, ``lmforge/parallel/comm_hooks.py``).

    torchrun --nproc-per-node=2 comm_hook_worker.py RUN_DIR

A tiny llama (2 blocks, width 32, vocab 64, FP32) wrapped by lmforge's ``apply_ddp`` with each hook, every
rank reading its own random batches (drawn from a seed of the rank and the step). Prints on rank 0
``RESULTS {json}``:

* ``bf16`` / ``fp16``: the largest difference between DDP's averaged gradient and the hand computation
  from the two ranks' plain gradients (gathered from a copy without DDP): ``float32(round16(
  round16(g_0) / 2 + round16(g_1) / 2))``, the sum rounded to 16 bits as the 16-bit all-reduce does;
  the bytes the hook counted for one step, and the model's parameter count (counted here);
* ``none_bytes``: what the plain all-reduce sends by lmforge's count;
* ``losses``: per step, uncompressed and PowerSGD (rank 2, from step 2) over ``STEPS`` AdamW steps;
* ``psgd_bytes``: PowerSGD's bytes per compressed step, and ``psgd_expected``: ``sum over matrices
  (n + m) r + the other tensors' elements``, times 4, computed here from the parameter shapes;
* ``resume``: PowerSGD run to ``CUT`` steps, checkpointed with lmforge's ``save_checkpoint`` (per-rank
  ``comm/`` files), loaded into a model built from another seed, continued to ``STEPS``: the largest
  difference of its parameters to the uninterrupted run's, on every rank (gathered), and whether DDP's
  bucket layout changed under the hook (the state was re-laid); ``without_state``: the same difference
  when the resumed hook starts without its state (error feedback and ``Q`` lost);
* ``differential``: differential checkpoints over the two ranks (:func:`differential`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lmforge.config import Config, ModelConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.parallel.comm_hooks import CommHook, comm_hook
from lmforge.parallel.data_parallel import apply_ddp
from lmforge.parallel.layout import init_layout
from lmforge.train.checkpoint import (
    Differential,
    digests,
    load_training_state,
    model_state,
    optimizer_state,
    save_checkpoint,
    unchanged_keys,
)
from lmforge.train.runtime import rng_state

CPU = torch.device("cpu")
MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64)
VOCAB, SEQ, ROWS = 64, 16, 4
STEPS, CUT = 8, 5


def build(seed: int) -> tuple[Transformer, NextTokenLoss]:
    torch.manual_seed(seed)
    model = Transformer(MODEL, VOCAB, SEQ)
    model.init_weights()
    return model, NextTokenLoss(model)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(start + i * stride) % VOCAB``, random start and stride in 1..3: learnable in a few steps."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, VOCAB, (ROWS, 1), generator=g)
    stride = torch.randint(1, 4, (ROWS, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def mean_loss(fn, rank: int, step: int) -> torch.Tensor:
    inputs, targets = batch(rank, step)
    loss_sum, count = fn(inputs, targets)
    return loss_sum / count


def compressed_grads(layout, dtype: torch.dtype, kind: str) -> dict:
    rank = dist.get_rank()
    _, plain = build(0)
    model, objective = build(0)
    hook = CommHook(kind, layout.group("dp"))
    ddp = apply_ddp(objective, layout, CPU, comm=hook)
    mean_loss(plain, rank, 0).backward()
    mean_loss(ddp, rank, 0).backward()
    worst = 0.0
    for p, q in zip(plain.parameters(), objective.parameters(), strict=True):
        both = [torch.empty_like(p.grad) for _ in range(2)]
        dist.all_gather(both, p.grad)
        halves = [(g.to(dtype) / 2).to(dtype) for g in both]
        expected = (halves[0] + halves[1]).to(dtype).float()
        worst = max(worst, (q.grad - expected).abs().max().item())
    return {
        "diff": worst,
        "bytes": hook.take_bytes_per_step(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def train(
    layout,
    cfg: Config,
    seed: int,
    steps: range,
    run_dir: Path | None = None,
    save_at: int = 0,
    keep_comm: bool = True,
):
    """AdamW steps ``steps`` of a fresh model (from ``seed``; with ``run_dir`` and no ``save_at``: loaded
    from that run's checkpoint first, the hook's state too unless not ``keep_comm``); returns (losses,
    model, hook)."""
    rank = dist.get_rank()
    model, objective = build(seed)
    hook = comm_hook(cfg.parallel, layout.group("dp"), 1337, 2)
    ddp = apply_ddp(objective, layout, CPU, comm=hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if run_dir is not None and not save_at:
        folder = run_dir / "checkpoints" / f"step_{steps.start:08d}"
        state = load_training_state(folder, model, opt)
        if keep_comm:
            hook.load_state_dict(state["comm"])
    losses = []
    for step in steps:
        loss = mean_loss(ddp, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if save_at and step + 1 == save_at:
            state = {
                "model": model_state(model),
                "optimizer": optimizer_state(model, opt),
                "rng": rng_state(),
                "comm": hook.state_dict(),
            }
            save_checkpoint(run_dir, save_at, state, "", keep=2)
    return losses, model, hook


def expected_psgd_bytes(model: Transformer, rank: int) -> int:
    """``(n + m) r`` per compressed matrix (``n m > 2 (n + m) r``), every element of the others, x 4."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if n * m > 2 * (n + m) * r else n * m
    return total * 4


def differential(run_dir: Path, model: Transformer) -> dict:
    """Differential checkpoints over 2 ranks: the unchanged keys agreed (a key one rank saw change is
    written), and a differential save of the DDP model's state after one tensor changed, restored into a
    model built from another seed: the largest difference to the state saved (0: bitwise)."""
    rank = dist.get_rank()
    # rank 1 holds "b" changed, rank 0 unchanged; "c" only on rank 0 (ZeRO-1 or a pipeline), unchanged
    now = {"a": "x", "b": "y" if rank == 0 else "z", **({"c": "w"} if rank == 0 else {})}
    agreed = sorted(unchanged_keys(now, {"a": "x", "b": "y", "c": "w"}))
    first = {"model": model_state(model), "optimizer": {}, "rng": rng_state()}
    save_checkpoint(run_dir, 100, first, "", keep=5)
    base = digests({"model": first["model"]})
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight.add_(1.0)
    second = {"model": model_state(model), "optimizer": {}, "rng": rng_state()}
    same = unchanged_keys(digests({"model": second["model"]}), base)
    save_checkpoint(run_dir, 101, second, "", keep=5, differential=Differential("step_00000100", same))
    fresh, _ = build(11)
    opt = torch.optim.AdamW(fresh.parameters())
    state = load_training_state(run_dir / "checkpoints" / "step_00000101", fresh, opt)
    fresh.load_state_dict(state["model"])
    worst = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    return {"agreed": agreed, "written": sorted(set(second["model"]) - {k[6:] for k in same}), "diff": worst}


def main() -> None:
    torch.set_num_threads(1)
    run_dir = Path(sys.argv[1])
    plain_cfg = Config(parallel={"dp_replicate": 2})
    layout = init_layout(plain_cfg, "cpu")
    out: dict = {
        "bf16": compressed_grads(layout, torch.bfloat16, "bf16"),
        "fp16": compressed_grads(layout, torch.float16, "fp16"),
    }
    none_losses, _, none_hook = train(layout, plain_cfg, 0, range(STEPS))
    out["none_bytes"] = none_hook.take_bytes_per_step()
    psgd_cfg = Config(
        parallel={"dp_replicate": 2, "ddp_comm_hook": "powersgd", "powersgd": {"rank": 2, "start_step": 2}}
    )
    psgd_losses, whole, hook = train(layout, psgd_cfg, 0, range(STEPS))
    hook.take_bytes_per_step()
    psgd_part, _, part_hook = train(layout, psgd_cfg, 0, range(CUT), run_dir, save_at=CUT)
    out["psgd_bytes_mixed"] = part_hook.take_bytes_per_step()  # 2 plain + 3 compressed steps: a mean
    rest, resumed, rest_hook = train(layout, psgd_cfg, 7, range(CUT, STEPS), run_dir)
    out["psgd_bytes"] = rest_hook.take_bytes_per_step()
    _, fresh, _ = train(layout, psgd_cfg, 7, range(CUT, STEPS), run_dir, keep_comm=False)
    out["psgd_expected"] = expected_psgd_bytes(whole, 2)
    out["losses"] = {"none": none_losses, "powersgd": psgd_losses, "resumed": psgd_part + rest}
    worst = torch.tensor(
        max((a - b).abs().max().item() for a, b in zip(whole.parameters(), resumed.parameters(), strict=True))
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    fresh_worst = max(
        (a - b).abs().max().item() for a, b in zip(whole.parameters(), fresh.parameters(), strict=True)
    )
    out["resume"] = {"diff": worst.item(), "relaid": rest_hook.relaid, "without_state": fresh_worst}
    out["differential"] = differential(run_dir / "diff", whole)
    out["comm_files"] = sorted(
        p.name for p in (run_dir / "checkpoints" / f"step_{CUT:08d}" / "comm").iterdir()
    )
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
