"""Worker of ``tests/test_pipeline_parallel.py`` (run under torchrun, gloo on CPU).

For each schedule named on the command line: a tiny Llama in float64 (the FP32 initial draws widened, as
``train.precision = "fp64"`` makes them, so that only summation order separates the runs) trained 3 AdamW steps through
:class:`lmforge.parallel.pipeline.Pipeline` (each rank's optimizer over its own stages), and the same 3 steps
of the whole model through the single-process ``train_step`` on every rank. Variants: ``NAME+accum`` splits
each step's batch over two ``Pipeline.step`` calls (gradients accumulate across calls), ``NAME+mesh`` gives
the pipeline a 1-D device mesh instead of the default group, ``NAME+tied`` ties the embedding and the
output head (against a tied single-process model; the copies' gradients are summed by
``reduce_tied_grads`` after each step's last call, and ``tied_equal`` says whether every copy of the matrix
on every rank is bitwise the same after the run). After step 2 both evaluate a
batch (the pipeline through ``eval_loss``, then switches back to training). Rank 0 writes one JSON line per
schedule to the output file: the largest relative differences of the step losses, the eval loss and the
parameters (gathered from every rank), and the bubble measured against the formula.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge.data.loader import Batch
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.clip import Clipper
from lmforge.parallel.layout import end_process_group
from lmforge.parallel.pipeline import Pipeline
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config
from lmforge.train.build import build_model
from lmforge.train.modules import LanguageModelModule
from lmforge.train.step import train_step

VOCAB, SEQ, BATCH, MICRO, STEPS, LR = 128, 32, 8, 4, 3, 3e-3
SETTINGS = {
    "model.n_layers": 4,
    "model.d_model": 64,
    "model.n_heads": 4,
    "model.tie_embeddings": False,
    "data.seq_len": SEQ,
    "train.precision": "fp64",
    "train.grad_clip": 0.0,
    "train.seed": 1234,
}
CFGS = {tied: load_config(None, {**SETTINGS, "model.tie_embeddings": tied}) for tied in (False, True)}
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}


def batches(step: int) -> Batch:
    """A batch of random tokens in documents of random lengths, some targets ignored (-100)."""
    g = torch.Generator().manual_seed(100 + step)
    inputs = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[torch.rand(BATCH, SEQ, generator=g) < 0.1] = -100
    doc_ids = (torch.rand(BATCH, SEQ, generator=g) < 0.15).cumsum(1)
    return Batch(inputs, targets, doc_ids)


def split(batch: Batch) -> list[Batch]:
    rows = BATCH // MICRO
    return [
        Batch(*(t[i : i + rows] for t in (batch.inputs, batch.targets, batch.doc_ids)))
        for i in range(0, BATCH, rows)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference(tied: bool) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    """Step losses, the eval loss after step 2 and the final parameters (a tied matrix under both its
    names) of the single-process run."""
    cfg = CFGS[tied]
    model = build_model(cfg, VOCAB, torch.device("cpu")).to(torch.float64)  # the FP32 draws, widened
    objective = NextTokenLoss(model, cfg.train.loss_chunk)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    clipper, precision = Clipper.from_config(cfg.train), PrecisionPolicy.resolve("fp64", torch.device("cpu"))
    losses, eval_loss = [], float("nan")
    for step in range(STEPS):
        if step == 2:
            with torch.no_grad():
                b = batches(99)
                loss_sum, n = objective(b.inputs, b.targets, b.doc_ids)
                eval_loss = float(loss_sum / n)
        module = LanguageModelModule.of(objective)
        losses.append(float(train_step(module, opt, split(batches(step)), LR, clipper, precision).loss))
    params = model.named_parameters(remove_duplicate=False)
    return losses, eval_loss, {k: v.detach().clone() for k, v in params}


def pipelined(variant: str) -> tuple[list[float], float, dict[str, torch.Tensor], list[tuple[float, float]]]:
    """The same run through the pipeline: losses and eval loss (NaN off the last stage), this rank's
    parameters, and (measured, formula) bubble of each step."""
    schedule, *options = variant.split("+")
    calls = 2 if "accum" in options else 1
    cfg = CFGS["tied" in options]
    group = (
        init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
        if "mesh" in options
        else None
    )

    def build() -> Transformer:  # float64 on the meta device: the stages' init widens the FP32 draws
        return Transformer(cfg.model, VOCAB, SEQ, attention=cfg.train.attention).to(torch.float64)

    pipe = Pipeline(build, group, schedule, MICRO, STAGES_PER_RANK[schedule], seed=cfg.train.seed)
    opt = torch.optim.AdamW(list({id(p): p for m in pipe.models for p in m.parameters()}.values()), lr=LR)
    losses, eval_loss, bubbles = [], float("nan"), []
    for step in range(STEPS):
        if step == 2:
            b = batches(99)
            out = pipe.eval_loss(b.inputs, b.targets, b.doc_ids)
            eval_loss = float(out[0] / out[1]) if out is not None else float("nan")
        b = batches(step)
        parts = [t.chunk(calls) for t in (b.inputs, b.targets, b.doc_ids)]
        out = [pipe.step(x, y, d, loss_scale=1.0 / b.n_targets) for x, y, d in zip(*parts, strict=True)]
        pipe.reduce_tied_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(sum(out)) if out[0] is not None else float("nan"))
        bubbles.append((pipe.last_bubble, pipe.expected_bubble))
    params = {k: v.detach().clone() for m in pipe.models for k, v in m.named_parameters()}
    return losses, eval_loss, params, bubbles


def main() -> None:
    out_path, schedules = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    refs = {tied: reference(tied) for tied in {"+tied" in s for s in schedules}}
    lines = []
    for schedule in schedules:
        ref_losses, ref_eval, ref_params = refs["+tied" in schedule]
        losses, eval_loss, params, bubbles = pipelined(schedule)
        param_err = max(rel(v, ref_params[k]) for k, v in params.items())
        loss_err = max(
            (abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True) if a == a), default=-1.0
        )
        eval_err = abs(eval_loss - ref_eval) / abs(ref_eval) if eval_loss == eval_loss else -1.0
        local = {
            "rank": rank,
            "names": sorted(params),
            "param_err": param_err,
            "loss_err": loss_err,
            "eval_err": eval_err,
            "bubbles": bubbles,
            "tied": [params[k] for k in ("embed.weight", "lm_head.weight") if k in params],
        }
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        names = sorted(n for g in gathered for n in g["names"])
        tied = [t for g in gathered for t in g["tied"]]
        lines.append(
            {
                "schedule": schedule,
                "covers_all_params": names == sorted(ref_params),
                "param_err": max(g["param_err"] for g in gathered),
                "loss_err": max(g["loss_err"] for g in gathered),
                "eval_err": max(g["eval_err"] for g in gathered),
                "bubbles": {g["rank"]: g["bubbles"] for g in gathered},
                "tied_equal": all(torch.equal(t, tied[0]) for t in tied) if "+tied" in schedule else None,
            }
        )
    if rank == 0:
        with open(out_path, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    end_process_group()  # the pipelines' groups and works collected first, then every rank past its last message


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()
