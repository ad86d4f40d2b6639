"""The model and the batch against the layout that cuts them: pipeline stages (layers, micro-batches, the
schedule's limits) and tensor-parallel shards (heads, widths), checked before any work. ``lmforge train``
(``train/build.py::validate``) and ``lmforge estimate`` (``plan/request.py``) refuse with the same line."""

from __future__ import annotations

import torch
from torch import nn

from lmforge.config import Config, check_moe
from lmforge.errors import ConfigError
from lmforge.model.lora import target_names
from lmforge.model.transformer import Transformer
from lmforge.parallel.pipeline import check_pipeline, pipeline_settings
from lmforge.parallel.tensor import check_tensor_parallel


def check_lora(cfg: Config) -> None:
    """``[lora]``: its targets must name linear layers of the model (a meta model is built to look), and
    the adapters run where they are supported: not with tensor or pipeline parallelism, FP8 or (QLoRA)
    more than one process."""
    lora, p = cfg.lora, cfg.parallel
    if lora.rank == 0:
        return
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.data.vocab_size or 256, cfg.data.seq_len)
    if not target_names(model, lora.targets):
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"lora.targets: {lora.targets!r} names no linear layer of the model; use all-linear or names "
            f"among {','.join(x for x in linears if x != 'lm_head')}"
        )
    layout = ", ".join(
        f"parallel.{k} = {getattr(p, k)}"
        for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")
        if getattr(p, k) > 1
    )
    refusals = (
        (p.tp > 1, "parallel.tp", "tensor parallelism would shard the adapters as their base layer"),
        (p.pp > 1, "parallel.pp", "pipeline stages are not adapted"),
        (cfg.train.precision == "fp8", "train.precision", "fp8 converts the linear layers LoRA adapts"),
        (
            lora.quantize == "nf4" and p.pp * p.dp_replicate * p.dp_shard * p.tp > 1,
            "lora.quantize",
            f"nf4 (QLoRA) runs in one process, not with {layout}; use lora.quantize = none under torchrun",
        ),
    )
    for refused, key, why in refusals:
        if refused:
            raise ConfigError(f"{key}: not with lora.rank > 0 ({why})")


# the objectives a pipeline cannot run: its last stage computes the next-token loss of its microbatches
PIPELINE_REFUSES = {
    "dpo": "DPO compares whole sequences' log-probabilities, which one stage does not hold",
    "reward": "the reward head reads the whole network's last hidden state, which one stage does not hold",
    "rl": "no stage holds the whole policy to sample from, and the last computes a next-token loss, not the "
    "completions' log-probabilities weighed by their advantages",
}


def check_model_layout(cfg: Config) -> None:
    """The model and batch must divide as the layout cuts them (pipeline stages, tensor-parallel shards);
    MoE layers only where they are supported (``model/moe.py::check_moe``); LoRA (:func:`check_lora`)."""
    p = cfg.parallel
    objective = cfg.train.objective
    if p.pp > 1 and objective in PIPELINE_REFUSES:
        which = f"train.objective = {objective}" + (
            f" (rl.algorithm = {cfg.rl.algorithm})" if objective == "rl" else ""
        )
        raise ConfigError(
            f"parallel.pp: not with {which}: {PIPELINE_REFUSES[objective]}; use data parallelism, FSDP2 "
            "or tensor parallelism (--parallel.pp=1)"
        )
    # a pipeline runs each micro-batch as its microbatches: MoE capacity is per part
    chunks = (
        pipeline_settings(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank)[0] if p.pp > 1 else 1
    )
    check_moe(cfg, chunks)
    check_lora(cfg)
    if p.pp > 1:
        microbatches, v = pipeline_settings(p.pp, p.pp_schedule, p.pp_microbatches, p.pp_stages_per_rank)
        check_pipeline(
            cfg.model.n_layers, p.pp, p.pp_schedule, microbatches,
            None if cfg.train.micro_batch_size == "auto" else cfg.train.micro_batch_size, v,
        )  # fmt: skip
        if p.pp_schedule in ("zero_bubble", "zbv") and cfg.train.activation_checkpointing == "selective":
            raise ConfigError(
                f"train.activation_checkpointing: selective checkpointing allows one backward through a "
                f"block, and the {p.pp_schedule} schedule runs two (input, then weight gradients); use full "
                "or every:K with this schedule, or another parallel.pp_schedule"
            )
        if p.pp_schedule in ("zero_bubble", "zbv") and (p.dp_shard > 1 or p.tp > 1):
            # measured (torch 2.13, gloo): with dp_shard = 2 the losses leave one process's from step 2 on;
            # with tp = 2 the weight-gradient pass stops ("Can't detach views in-place")
            key = "parallel.dp_shard" if p.dp_shard > 1 else "parallel.tp"
            raise ConfigError(
                f"{key}: the {p.pp_schedule} schedule computes weight gradients in a second pass, which FSDP2 "
                "and tensor-parallel stages do not follow (other weights than one process's, or a failure); "
                "use --parallel.pp_schedule=1f1b or interleaved_1f1b with them"
            )
        if cfg.train.clip_mode == "group_norm":
            raise ConfigError(
                "train.clip_mode: group_norm clips per optimizer group, and pipeline stages hold different "
                "groups; use --train.clip_mode=norm with parallel.pp"
            )
    if p.tp > 1:
        check_tensor_parallel(cfg.model, cfg.data.vocab_size, cfg.data.seq_len, p.tp)


def check_compiled_layout(cfg: Config, device: torch.device) -> None:
    """What a run refuses of compile with its layout on ``device`` (the planner, which lays out runs for
    other machines, does not ask): compiled tensor-parallel blocks on a CPU.

    The blocks compiled in place pass sequence-parallel DTensors between them; in backward AOTAutograd
    hands the eager redistribution before the first block a plain tensor ("'Tensor' object has no
    attribute '_local_tensor'"; torch 2.13, gloo, 2 CPU processes, found by the distributed combination
    matrix; Dynamo without AOTAutograd runs). Not measured on CUDA, so not refused there."""
    p = cfg.parallel
    if p.tp > 1 and cfg.train.compile and device.type == "cpu":
        raise ConfigError(
            f"train.compile: not with parallel.tp = {p.tp} on a CPU (the compiled blocks' backward fails on "
            "the tensor-parallel DTensors in torch 2.13); set --train.compile=false, or use FSDP2 / DDP with "
            "compile"
        )
