"""Every optimizer under every data-parallel layout, against one process (run by tests/test_optim_distributed.py).

``torchrun --nproc-per-node=2 optim_worker.py --out FILE [--dtype float64] [--mutate] NAME...`` checks, for
each optimizer NAME, a tiny model trained ``STEPS`` steps on batches of ``BATCH`` sequences, each rank
running its share:

* ``fsdp2``: ``fully_shard`` on each block and on the objective (1-D mesh of all ranks);
* ``zero``: DDP and ``ZeroRedundancyOptimizer`` (ZeRO-1, :func:`build_zero_optimizer`);

each rank's loss is its share's token-loss sum over the whole batch's targets times the world size, so the
wrappers' average over ranks is the whole batch's gradient. Two references run in one process (on every
rank): ``micro`` accumulates the gradient over the ranks' shares in rank order, which is the same sum in
the same order as the ranks' reduction (power-of-two scales are exact), so its gradients are bitwise those
of the distributed runs and any difference is the optimizer's; ``whole`` takes the batch in one backward,
whose gradient differs in the last bits. Then:

* ``dcp``: the FSDP2 model and optimizer through ``get_state_dict`` (flattened), ``dcp.save``, and
  ``set_state_dict`` into a fresh FSDP2 model and optimizer and into a fresh plain one; each takes one more
  step (compared with the ``micro`` reference's), and their state is compared with the saved one;
* ``zero_resume`` / ``zero_to_plain``: ZeRO-1's consolidated state dict loaded into a fresh ZeRO-1
  optimizer and into a plain one, one more step each;
* ``fsdp2_grad`` / ``zero_grad`` (and ``..._whole``): the first step's gradients against the references';
* ``quantised``: how many 8-bit moments each run holds (AdamW8bit; 0 for the others);
* ``placements``: the bare optimizer over DTensor parameters placed every way of ``placements_for`` against a
  plain copy, both fed the same gradients (the step alone). With 4 ranks (``--placements-only``) the mesh
  is 2 x 2, as FSDP2 over tensor parallelism.

Rank 0 writes ``{name: {check: difference | "error: ..."}}`` as JSON to ``--out``. A parameter difference
is the largest over parameters of ``max |a - b| / max |b|``; a state difference the same over state tensors.

``--dtype float64``: every model, gradient and optimizer state in float64, so that a difference of
summation order is ~1e-16 rather than FP32's ~1e-7 (the initial values are the FP32 draws, widened).
``--mutate``: the data-parallel reductions divide by ``world * (1 + 2**-23)`` instead of ``world`` (FSDP2's
gradient divide factor, a DDP communication hook): a one-ulp-of-FP32 error of scaling, which the float64
checks must see.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer, build_zero_optimizer
from lmforge.parallel.layout import end_process_group

STEPS = 3
VOCAB, SEQ, BATCH = 128, 32, 8
MODEL = ModelConfig(d_model=64, n_heads=4, n_layers=2)
CPU = torch.device("cpu")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
DTYPE = torch.float32  # --dtype, but FP32 for the optimizers of FP32_ONLY
# torchao's 8-bit AdamW computes its moments in FP32 (``exp_avg.float().lerp(grad.float(), ...)``), which a
# DTensor float64 parameter refuses (``aten.lerp``: "expected dtype torch.float64 for `end`"): FP32 only
FP32_ONLY = {"adamw8bit"}
MUTATE = False  # --mutate
ULP = 1 + 2**-23  # the mutation's factor: one FP32 ulp of 1


def optim_cfg(name: str) -> OptimConfig:
    """Weight decay and a per-kind multiplier exercise the group keys through every wrapper."""
    return OptimConfig(name=name, lr=3e-3, weight_decay=0.1, group_lr_mult={"norm": 2.0})


def fresh_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(MODEL, VOCAB, SEQ)
    model.init_weights()  # FP32 draws, then widened: the same initial values in every dtype
    return model.to(DTYPE)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS + 1):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def train(objective, optimizer, data, lr: float, how: str, grads: dict | None = None) -> None:
    """One step per batch, the gradient taken ``how``: ``whole`` (one backward), ``micro`` (one backward per
    rank's share, accumulated in rank order) or ``rank`` (this rank's share; the wrapper averages).
    ``grads``: filled with the first step's whole gradients by parameter name."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for inputs, targets in data:
        for group in optimizer.param_groups:  # as the training loop does: a float rate per group
            group["lr"] = lr * group.get("lr_mult", 1.0)
        n = targets.numel()
        if how == "whole":
            shares, scale = [(inputs, targets)], 1
        elif how == "micro":
            shares, scale = list(zip(inputs.chunk(world), targets.chunk(world), strict=True)), 1
        else:
            shares, scale = [(inputs.chunk(world)[rank], targets.chunk(world)[rank])], world
        for x, y in shares:
            loss_sum, _ = objective(x, y)
            (loss_sum / n * scale).backward()
        if grads is not None and not grads:
            model = objective.module if isinstance(objective, DistributedDataParallel) else objective
            grads.update({k: whole(p.grad).clone() for k, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def param_diff(model: nn.Module, ref: nn.Module) -> float:
    """Largest over parameters of ``max |a - b| / max |b|``."""
    worst = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        a, b = whole(p.detach()), ref_params[name].detach()
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


def grad_diff(got: dict, want: dict) -> float:
    """Largest over parameters of ``max |a - b| / max |b|`` of two gradient dicts."""
    return max(((got[k] - b).abs().max() / b.abs().max()).item() for k, b in want.items())


def flat_state(model: nn.Module, optimizer) -> dict:
    """The optimizer's state by parameter name: copies of the whole tensors."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    sd = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items() if k.startswith("state.")
    }


def state_diff(a: dict, b: dict) -> float:
    """Largest over state tensors of ``max |a - b| / max |b|`` (absolute where ``b`` is all zeros)."""
    if a.keys() != b.keys():
        raise AssertionError(f"state keys differ: {sorted(a.keys() ^ b.keys())[:4]}")
    worst = 0.0
    for k, v in a.items():
        if not isinstance(v, torch.Tensor):
            if v != b[k]:
                raise AssertionError(f"{k}: {v!r} != {b[k]!r}")
            continue
        x, y = whole(v).double(), whole(b[k]).double()
        worst = max(
            worst, ((x - y).abs().max() / y.abs().max().clamp(min=1.0 if y.eq(0).all() else 0)).item()
        )
    return worst


def n_quantised(optimizer) -> int:
    """How many state tensors of ``optimizer`` (ZeRO-1: of every rank's) are 8-bit, as the rank holds them."""
    inner = getattr(optimizer, "optim", optimizer)
    n = sum(
        type(v.to_local() if isinstance(v, DTensor) else v).__name__ == "OptimState8bit"
        for state in inner.state.values()
        for v in state.values()
    )
    if inner is not optimizer:  # ZeRO-1: each rank holds its own parameters' states
        total = torch.tensor(n)
        dist.all_reduce(total)
        n = int(total)
    return n


def shard(model: Transformer) -> NextTokenLoss:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    objective = fully_shard(NextTokenLoss(model), mesh=mesh)
    if MUTATE:
        for module in objective.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(dist.get_world_size() * ULP)
    return objective


def ddp(objective: nn.Module) -> DistributedDataParallel:
    """DDP over ``objective``; with ``--mutate`` its gradients averaged with the mutated divisor."""
    wrapped = DistributedDataParallel(objective)
    if MUTATE:
        wrapped.register_comm_hook(dist.get_world_size() * ULP, _divided_all_reduce)
    return wrapped


def _divided_all_reduce(divisor: float, bucket):  # no return annotation: DDP checks it as an object
    """DDP's all-reduce hook, dividing by ``divisor`` where torch's divides by the world size."""
    work = dist.all_reduce(bucket.buffer().div_(divisor), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def attempt(out: dict, key: str, fn) -> None:
    """``out[key] = fn()``, or the error as text (reported per check, not fatal for the others)."""
    try:
        result = fn()
        out.update(result) if isinstance(result, dict) else out.__setitem__(key, result)
    except Exception as exc:
        traceback.print_exc()
        out[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"


def check(name: str, tmp: str) -> dict:
    cfg = optim_cfg(name)
    data = batches()
    out: dict = {}
    refs: dict = {"grads": {}}
    out["dtype"] = str(DTYPE).removeprefix("torch.")
    for how in ("micro", "whole"):
        ref = fresh_model()
        ref_opt = build_optimizer(ref, cfg, CPU, compile=False)
        refs["grads"][how] = {}
        train(NextTokenLoss(ref), ref_opt, data[:STEPS], cfg.lr, how, refs["grads"][how])
        refs[how] = fresh_model()
        refs[how].load_state_dict(ref.state_dict())
        if how == "micro":
            refs["state"] = flat_state(ref, ref_opt)
            out["quantised"] = {"reference": n_quantised(ref_opt)}
            train(NextTokenLoss(ref), ref_opt, data[STEPS:], cfg.lr, how)  # the step the resumed runs take
            refs["next"] = ref
    # one process twice, the batch's gradient summed in two orders: the noise of summation order
    out["noise_whole"] = param_diff(refs["whole"], refs["micro"])
    out["noise_whole_from_micro"] = param_diff(refs["micro"], refs["whole"])  # the layouts' normalisation
    out["noise_grad"] = grad_diff(refs["grads"]["whole"], refs["grads"]["micro"])

    def fsdp2() -> dict:
        model = fresh_model()
        objective = shard(model)  # before the optimizer: fully_shard replaces the parameters
        opt = build_optimizer(model, cfg, CPU, compile=False)
        grads: dict = {}
        train(objective, opt, data[:STEPS], cfg.lr, "rank", grads)
        result = {
            "fsdp2_grad": grad_diff(grads, refs["grads"]["micro"]),
            "fsdp2_grad_whole": grad_diff(grads, refs["grads"]["whole"]),
            "fsdp2": param_diff(model, refs["micro"]),
            "fsdp2_whole": param_diff(model, refs["whole"]),
            "fsdp2_state": state_diff(flat_state(model, opt), refs["state"]),
        }
        out["quantised"]["fsdp2"] = n_quantised(opt)
        attempt(
            result,
            "dcp",
            lambda: dcp_round_trip(cfg, model, opt, data, os.path.join(tmp, name), refs, out["quantised"]),
        )
        return result

    def zero() -> dict:
        model = fresh_model()
        opt = build_zero_optimizer(model, cfg, CPU, compile=False)
        grads: dict = {}
        train(ddp(NextTokenLoss(model)), opt, data[:STEPS], cfg.lr, "rank", grads)
        result = {
            "zero_grad": grad_diff(grads, refs["grads"]["micro"]),
            "zero_grad_whole": grad_diff(grads, refs["grads"]["whole"]),
            "zero": param_diff(model, refs["micro"]),
            "zero_whole": param_diff(model, refs["whole"]),
        }
        out["quantised"]["zero"] = n_quantised(opt)
        attempt(result, "zero_resume", lambda: zero_resume(cfg, model, opt, data, refs, out["quantised"]))
        return result

    attempt(out, "fsdp2", fsdp2)
    attempt(out, "zero", zero)
    attempt(out, "placements", lambda: placements(cfg, dist.get_world_size()))
    return out


def dcp_round_trip(cfg: OptimConfig, model, opt, data, path: str, refs: dict, quantised: dict) -> dict:
    saved = flat_state(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    out = {}
    for layout in ("dcp_fsdp2", "dcp_plain"):
        fresh = fresh_model()
        objective = shard(fresh) if layout == "dcp_fsdp2" else NextTokenLoss(fresh)
        fresh_opt = build_optimizer(fresh, cfg, CPU, compile=False)
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt, options=FLAT)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
        )
        out[f"{layout}_state"] = state_diff(flat_state(fresh, fresh_opt), saved)
        quantised[layout] = n_quantised(fresh_opt)
        train(objective, fresh_opt, data[STEPS:], cfg.lr, "rank" if layout == "dcp_fsdp2" else "micro")
        out[layout] = param_diff(fresh, refs["next"])
    return out


def zero_resume(cfg: OptimConfig, model, opt, data, refs: dict, quantised: dict) -> dict:
    """ZeRO-1's own checkpoint (``consolidate_state_dict`` to rank 0, ``state_dict`` there, given to every
    rank) loaded into a fresh ZeRO-1 optimizer and into a plain one over a copy of the model (the
    consolidated dict is a plain optimizer's); one more step each, compared with the reference's."""
    opt.consolidate_state_dict(to=0)
    sd = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(sd, src=0)
    out = {}
    for layout in ("zero_resume", "zero_to_plain"):
        fresh = fresh_model()
        fresh.load_state_dict(model.state_dict())
        if layout == "zero_resume":
            objective, how = ddp(NextTokenLoss(fresh)), "rank"
            fresh_opt = build_zero_optimizer(fresh, cfg, CPU, compile=False)
        else:
            objective, how = NextTokenLoss(fresh), "micro"
            fresh_opt = build_optimizer(fresh, cfg, CPU, compile=False)
        fresh_opt.load_state_dict(copy.deepcopy(sd[0]))  # loading keeps the given tensors as the state
        quantised[layout] = n_quantised(fresh_opt)
        train(objective, fresh_opt, data[STEPS:], cfg.lr, how)
        out[layout] = param_diff(fresh, refs["next"])
    return out


class Bare(nn.Module):
    """Parameters named as in the model (Muon takes the ``blocks.*`` matrices: with ``width = 64`` one wide,
    one tall). With ``width = 512`` every shard is whole blocks of 256 values in every layout tried (8-bit)."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = nn.Embedding(96, width)
        self.blocks = nn.ModuleDict(
            {"0": nn.ModuleDict({"a": nn.Linear(width, 32), "b": nn.Linear(width, 96)})}
        )
        self.norm = nn.RMSNorm(width)


def placements_for(world: int) -> list[tuple]:
    if world == 2:
        return [(Shard(0),), (Shard(1),), (Replicate(),)]
    # FSDP2 over tensor parallelism: row-wise TP, column-wise TP (FSDP2 then splits a TP shard: strided)
    return [(Shard(0), Shard(1)), (_StridedShard(0, split_factor=2), Shard(0)), (Shard(0), Replicate())]


def placements(cfg: OptimConfig, world: int) -> dict:
    """The bare optimizer over DTensor shards against a plain copy fed the same gradients."""
    mesh = init_device_mesh("cpu", (world,) if world == 2 else (2, world // 2))
    out = {}
    for layout in placements_for(world):
        runs = []
        for sharded in (False, True):
            torch.manual_seed(0)
            model = Bare(512 if cfg.name == "adamw8bit" else 64).to(DTYPE)
            if sharded:
                for mod in model.modules():
                    for pname, p in list(mod.named_parameters(recurse=False)):
                        pls = [pl if p.ndim > 1 or not hasattr(pl, "dim") else Shard(0) for pl in layout]
                        mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, pls)))
            opt = build_optimizer(model, cfg, CPU, compile=False)
            g = torch.Generator().manual_seed(2)
            for _ in range(STEPS):
                for p in model.parameters():
                    grad = (torch.randn(p.shape, generator=g) * 1e-2).to(DTYPE)
                    p.grad = distribute_tensor(grad, mesh, p.placements) if sharded else grad
                opt.step()
            runs.append(model)
        out["/".join(map(str, layout))] = param_diff(runs[1], runs[0])
    return {"placements": max(out.values()), "placements_each": out}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--placements-only", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--mutate", action="store_true")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    global DTYPE, MUTATE
    MUTATE = args.mutate
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a rank left waiting fails, not hangs
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # one checkpoint directory for all ranks
        for name in args.names:
            start = time.perf_counter()
            DTYPE = torch.float32 if name in FP32_ONLY else getattr(torch, args.dtype)
            if args.placements_only:
                results[name] = {}
                cfg = optim_cfg(name)
                attempt(results[name], "placements", lambda: placements(cfg, dist.get_world_size()))  # noqa: B023
            else:
                results[name] = check(name, shared[0])
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            if dist.get_rank() == 0:
                print(name, results[name], flush=True)
        dist.barrier()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main()
