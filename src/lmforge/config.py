"""The typed, validated configuration schema: the one place where defaults live.

Every section is a pydantic model; unknown keys are errors and every field carries its default and a
description. Reading recipes, command-line overrides, error wording and the generated reference are in
:mod:`lmforge.recipe`; this module imports none of that, so anything may import the schema.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmforge.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MoEConfig(_Section):
    """Mixture of experts (``model/moe.py``, docs/moe.md): which blocks replace their MLP by routed SwiGLU
    experts, how tokens are routed and how the load is balanced. ``experts = 0`` keeps every block dense."""

    experts: int = Field(0, ge=0, description="routed experts per MoE block (0: dense model, no MoE)")
    top_k: int = Field(2, ge=1, description="experts each token is sent to (token-choice top-k)")
    shared_experts: int = Field(
        0,
        ge=0,
        description="experts every token goes through besides the routed ones (one SwiGLU of "
        "shared_experts x d_expert hidden units)",
    )
    d_expert: int | None = Field(
        None, ge=1, description="hidden width of each expert (default: the dense MLP's, model.d_ff)"
    )
    every: int = Field(1, ge=1, description="every k-th block (after first_dense) is an MoE block")
    first_dense: int = Field(0, ge=0, description="the first blocks kept dense (DeepSeek keeps 1 to 3)")
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="router scores: softmax over the experts, or an independent sigmoid each"
    )
    normalize: bool | None = Field(
        None,
        description="divide the chosen experts' scores by their sum (default: yes for sigmoid, no for "
        "softmax; with top_k = 1 and softmax keep it off, or the router gets no gradient from the loss)",
    )
    capacity_factor: float = Field(
        0.0,
        ge=0,
        description="0: dropless; else each expert takes at most floor(factor x tokens x top_k / experts) "
        "tokens of a training micro-batch, the rest of its assignments are dropped (counted)",
    )
    aux_loss: float = Field(
        0.0, ge=0, description="coefficient of the Switch/GShard load-balancing loss (0: off; e.g. 0.01)"
    )
    seq_aux_loss: float = Field(
        0.0, ge=0, description="coefficient of the sequence-wise balance loss of DeepSeek-V3 (0: off)"
    )
    z_loss: float = Field(0.0, ge=0, description="coefficient of the router z-loss (0: off; e.g. 0.001)")
    bias_update_rate: float = Field(
        0.0,
        ge=0,
        description="auxiliary-loss-free balancing: after each optimizer step every expert's routing bias "
        "moves by this much towards the mean load (0: off; e.g. 0.001)",
    )

    @model_validator(mode="after")
    def _routing(self) -> MoEConfig:
        if self.experts and self.top_k > self.experts:
            raise ValueError(
                f"model.moe.top_k: {self.top_k} exceeds model.moe.experts ({self.experts}); choose at most "
                "as many experts per token as there are"
            )
        return self

    def is_moe_block(self, index: int) -> bool:
        """Block ``index`` is an MoE block: experts on, ``index >= first_dense`` and
        ``(index - first_dense) % every == 0``."""
        return self.experts > 0 and index >= self.first_dense and (index - self.first_dense) % self.every == 0


class ModelConfig(_Section):
    """The decoder-only transformer. ``vocab_size`` comes from the tokenizer."""

    arch: Literal["llama", "gpt2"] = Field(
        "llama",
        description="llama: RMSNorm, SwiGLU, RoPE, GQA, no biases; gpt2: LayerNorm, GELU, learned positions, biases",
    )
    n_layers: int = Field(4, ge=1, description="number of transformer blocks")
    d_model: int = Field(256, ge=8, description="residual stream width")
    n_heads: int = Field(8, ge=1, description="attention (query) heads")
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads for GQA (default: n_heads)")
    d_ff: int | None = Field(
        None,
        ge=1,
        description="MLP hidden width (default: llama 8/3*d_model rounded up to 64, gpt2 4*d_model)",
    )
    tie_embeddings: bool = Field(True, description="share the input embedding with the output head")
    bias: bool | None = Field(None, description="biases in linear layers (default: gpt2 yes, llama no)")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency (llama)")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of RMSNorm / LayerNorm")
    init_std: float = Field(0.02, gt=0, description="std of the normal initialisation")
    doc_mask: bool = Field(
        True, description="tokens attend only within their own document in a packed sequence"
    )
    mup: bool = Field(
        False,
        description="muP (Tensor Programs V): width-aware init, hidden-matrix lr / width_mult, "
        "logits / width_mult, attention 1/d_head; equals the standard model at mup_base_width",
    )
    mup_base_width: int = Field(
        256, ge=8, description="muP: d_model at which the recipe was tuned (width_mult = d_model / this)"
    )
    moe: MoEConfig = Field(
        default_factory=MoEConfig, description="mixture of experts (experts = 0: every block dense)"
    )

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads: d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(
                f"model.n_kv_heads: n_heads ({self.n_heads}) must be divisible by n_kv_heads ({kv})"
            )
        if self.arch == "llama" and (self.d_model // self.n_heads) % 2:
            raise ValueError("model.n_heads: RoPE needs an even head dimension (d_model / n_heads)")
        if self.moe.experts and self.arch != "llama":
            raise ValueError("model.moe.experts: MoE blocks use SwiGLU experts; set model.arch = llama")
        if self.moe.experts and self.bias:
            raise ValueError("model.bias: MoE experts and routers have no biases; set model.bias = false")
        if self.moe.experts and not any(self.moe.is_moe_block(i) for i in range(self.n_layers)):
            raise ValueError(
                f"model.moe.first_dense: {self.moe.first_dense} keeps all {self.n_layers} blocks dense; "
                "lower it below model.n_layers"
            )
        if self.mup and self.mup_base_width % self.n_heads:
            raise ValueError(
                f"model.mup_base_width: {self.mup_base_width} must be divisible by n_heads ({self.n_heads})"
            )
        return self


class SourceConfig(_Section):
    """One input: a built-in corpus (``builtin:pystdlib``) or a file, folder or glob."""

    path: str = Field("builtin:pystdlib", description="builtin:pystdlib, or a file, folder or glob")
    format: Literal["auto", "txt", "jsonl", "parquet"] = Field(
        "auto", description="file format (auto: by suffix)"
    )
    text_field: str = Field("text", description="JSON key / parquet column holding the text")
    domain: str | None = Field(None, description="domain name (default: from the source)")


def check_weights(weights: dict[str, float], key: str) -> None:
    """Mixture weights are relative: each >= 0 and (when any are given) a positive sum."""
    for domain, w in weights.items():
        if not w >= 0:  # also rejects NaN
            raise ValueError(f"{key}.{domain}: weight {w} is negative; weights must be >= 0")
    if weights and not sum(weights.values()) > 0:
        raise ValueError(f"{key}: weights sum to 0; give at least one domain a positive weight")


class PhaseConfig(_Section):
    """One curriculum phase: its mixture weights and where it ends."""

    name: str | None = Field(None, description="label in logs and metrics (default: phase<N>)")
    until_step: int | None = Field(
        None, ge=1, description="the phase ends after this optimizer step (the last phase may omit it)"
    )
    until_tokens: int | None = Field(
        None, ge=1, description="or: ends at the first step at or past this many training tokens"
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="weight per domain in this phase (empty: data.weights)"
    )


class DataConfig(_Section):
    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig()], description="inputs")
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="sampling weight per domain, relative (empty: every sequence equally likely, "
        "i.e. domains by size); unlisted domains get 0",
    )
    phases: list[PhaseConfig] = Field(
        default_factory=list,
        description="curriculum: [[data.phases]] with until_step or until_tokens and weights, in order",
    )
    cache_dir: str = Field("data", description="folder for prepared corpora, tokenizers and token shards")
    vocab_size: int = Field(
        4096, ge=260, le=2**32 - 1, description="BPE vocabulary size (with special tokens)"
    )
    tokenizer: str | None = Field(None, description="path of an existing tokenizer.json (default: train one)")
    seq_len: int = Field(256, ge=8, description="tokens per training sequence")
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="share of documents held out, by id hash")
    include_tests: bool = Field(False, description="pystdlib: include the standard library's test suites")
    prepared: str | None = Field(
        None,
        description="train on the token shards of a 'lmforge data' output folder (OUT or OUT/tokens); "
        "sources, vocab_size, val_fraction and tokenizer are then not used",
    )

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        check_weights(self.weights, "data.weights")
        last: dict[str, int] = {}
        for i, phase in enumerate(self.phases):
            key = f"data.phases[{i}]"
            check_weights(phase.weights, f"{key}.weights")
            if phase.until_step is not None and phase.until_tokens is not None:
                raise ValueError(f"{key}: give until_step or until_tokens, not both")
            if phase.until_step is None and phase.until_tokens is None and i < len(self.phases) - 1:
                raise ValueError(f"{key}: only the last phase may omit until_step / until_tokens")
            for kind in ("until_step", "until_tokens"):
                value = getattr(phase, kind)
                if value is None:
                    continue
                if kind in last and value <= last[kind]:
                    raise ValueError(
                        f"{key}.{kind}: {value} is not after the previous phase's {last[kind]}; "
                        "phases must be increasing"
                    )
                last[kind] = value
        return self


class ValueClipConfig(_Section):
    """Settings of clipping each gradient element (``train.clip_mode = "value"``)."""

    limit: float = Field(0.0, ge=0, description="largest absolute gradient element kept")


class AdaptiveClipConfig(_Section):
    """Settings of the adaptive norm threshold (``train.clip_mode = "adaptive"``)."""

    factor: float = Field(
        2.0, gt=0, description="threshold as a multiple of the running mean of gradient norms"
    )
    beta: float = Field(
        0.98, ge=0, lt=1, description="decay of the running (exponential) mean of gradient norms"
    )
    warmup: int = Field(
        20,
        ge=1,
        description="steps measured before the adaptive threshold applies (train.grad_clip until then)",
    )


class LossScaleConfig(_Section):
    """Dynamic loss scaling of ``train.precision = "fp16"`` (``torch.amp.GradScaler``)."""

    init_scale: float = Field(2.0**16, gt=0, description="initial loss scale")
    growth_factor: float = Field(2.0, gt=1, description="scale multiplier after growth_interval clean steps")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="scale multiplier after an overflowing step")
    growth_interval: int = Field(2000, ge=1, description="consecutive clean steps before the scale grows")


class BatchScheduleConfig(_Section):
    """The global batch over the run (``optim/batch_schedule.py``): the micro-batch stays, the number of
    micro-batches a step changes. ``train.tokens_per_step`` is the full batch a schedule grows to."""

    name: Literal["constant", "ramp", "noise"] = Field(
        "constant",
        description="constant: train.tokens_per_step every step; ramp: from start_tokens_per_step up to "
        "train.tokens_per_step, linearly in the tokens seen over ramp_tokens; noise: from "
        "start_tokens_per_step, every interval steps grown to noise_multiple x the measured gradient noise "
        "scale (never shrunk, at most train.tokens_per_step)",
    )
    start_tokens_per_step: int | None = Field(
        None,
        ge=1,
        description="ramp / noise: the first steps' global batch in tokens (a multiple of micro_batch_size x "
        "seq_len x data-parallel ranks; noise: at least two of them, for two batch sizes to measure with)",
    )
    ramp_tokens: int = Field(
        0, ge=0, description="ramp: training tokens over which the batch reaches train.tokens_per_step"
    )
    interval: int = Field(10, ge=1, description="noise: steps between decisions")
    noise_multiple: float = Field(
        1.0, gt=0, description="noise: the batch aimed at, as a multiple of the smoothed noise scale B_simple"
    )
    lr_rule: Literal["none", "linear", "sqrt"] = Field(
        "sqrt",
        description="learning rate at batch B of the full batch B_full: lr x (B / B_full)^p with p = 1 "
        "(linear, for SGD), 1/2 (sqrt, for Adam-like optimizers) or 0 (none)",
    )

    @model_validator(mode="after")
    def _needs(self) -> BatchScheduleConfig:
        if self.name != "constant" and self.start_tokens_per_step is None:
            raise ValueError(
                f"train.batch_schedule.start_tokens_per_step: the {self.name!r} schedule starts from it; give "
                "the first steps' batch in tokens, e.g. a quarter of train.tokens_per_step"
            )
        if self.name == "ramp" and self.ramp_tokens == 0:
            raise ValueError(
                "train.batch_schedule.ramp_tokens: the ramp needs the tokens it grows over, e.g. a tenth of "
                "the run's tokens"
            )
        return self


def check_activation_checkpointing(policy: str) -> str:
    """``none``, ``full``, ``selective`` or ``every:K`` with K >= 1; else a one-line error."""
    if policy in ("none", "full", "selective"):
        return policy
    head, _, k = policy.partition(":")
    if head == "every" and k.isdigit() and int(k) >= 1:
        return policy
    raise ValueError(
        f"train.activation_checkpointing: {policy!r} is not a policy; use none, full, selective or every:K "
        "(K >= 1, e.g. every:2)"
    )


class TrainConfig(_Section):
    steps: int = Field(1050, ge=1, description="optimizer steps")
    micro_batch_size: int | Literal["auto"] = Field(
        8,
        description='sequences per forward/backward pass; "auto": the largest that lmforge estimate says '
        "fits this device (a probe on one CUDA GPU), train.tokens_per_step kept by the accumulation",
    )
    tokens_per_step: int | None = Field(
        None,
        ge=1,
        description="tokens per optimizer step, over all ranks (default: one micro-batch per rank)",
    )
    precision: Literal["auto", "fp32", "tf32", "bf16", "fp16", "fp8", "fp64"] = Field(
        "auto",
        description="fp32; tf32 (CUDA: TF32 matmuls); bf16 (autocast, fp32 master weights); fp16 (autocast "
        "with dynamic loss scaling); fp8 (torchao float8 linear layers, train.fp8_recipe, bf16 elsewhere); "
        "fp64 (everything float64, from the fp32 run's initial values: for verifying layouts against one "
        "process, not for training); auto: bf16 where the hardware has it",
    )
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "tensorwise", description="torchao float8 scaling recipe of train.precision = fp8"
    )
    loss_scale: LossScaleConfig = Field(
        default_factory=LossScaleConfig, description='used when train.precision = "fp16"'
    )
    activation_checkpointing: str = Field(
        "none",
        description="recompute activations in backward: none; full (every block); every:K (block i when "
        "i % K == 0: one in K); selective (every block, per op: keep matmul and attention outputs, recompute "
        "element-wise ops); an execution setting (a resume may change it)",
    )
    activation_offload: bool = Field(
        False,
        description="keep the tensors saved for backward in pinned host memory during the training step "
        "(save_on_cpu; CUDA only)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    compile: bool = Field(True, description="torch.compile the model (skipped where the platform cannot)")
    attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="attention kernel: auto = FlexAttention on CUDA with doc_mask, else SDPA"
    )
    moe_kernel: Literal["auto", "grouped_mm", "loop"] = Field(
        "auto",
        description="MoE experts' matrix products: grouped_mm (torch._grouped_mm, one call for all experts), "
        "loop (one matmul per expert); auto: grouped_mm where the device and dtype have it",
    )
    loss_chunk: int = Field(
        1024, ge=0, description="tokens per chunk of the output head + loss (0: all at once)"
    )
    deterministic: bool = Field(
        False,
        description="bitwise-reproducible runs on CPU in fp32: deterministic algorithms and fixed thread "
        "settings (slower)",
    )
    eval_interval: int = Field(250, ge=0, description="steps between evaluations (0: only at the end)")
    eval_tokens: int = Field(
        65536, ge=1, description="validation tokens per evaluation (capped by the split)"
    )
    checkpoint_interval: int = Field(250, ge=0, description="steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="newest checkpoints kept on disk (and the full ones that kept differential ones need)",
    )
    checkpoint_full_every: int = Field(
        1,
        ge=1,
        description="differential checkpoints: every N-th checkpoint of a process is full (the first always "
        "is), the N - 1 after it store only the tensors that changed since that full one and read the rest "
        "from it (restored bitwise); 1: every checkpoint full. Saves bytes where tensors stay unchanged "
        "(frozen weights, LoRA's base), not under full AdamW training",
    )
    async_checkpoint: bool = Field(
        False, description="write checkpoints in the background while training goes on (DCP async save)"
    )
    log_interval: int = Field(10, ge=1, description="steps between metrics lines")
    objective: str = Field(
        "lm",
        min_length=1,
        description="lm: next-token loss on data.sources; sft: response-token loss on [posttrain] records; "
        "dpo: preference loss on [posttrain] pairs with [dpo]'s settings; reward: a scalar reward head "
        "trained on [posttrain] pairs with [reward]'s settings; rl: policy gradient from rewards on "
        "[posttrain] prompts with [rl]'s settings (set by lmforge sft / dpo / reward / rl); or another "
        "registered objective (a package's entry point in the group lmforge.objectives), checked before "
        "any work",
    )
    early_stop_patience: int = Field(
        0,
        ge=0,
        description="stop after this many evaluations in a row without a new best validation loss, keeping "
        "the best checkpoint (0: never stop early)",
    )
    profile_steps: list[int] | None = Field(
        None,
        description="[A, B]: a torch.profiler trace of steps A..B (inclusive) in RUN/profile/ and a table of "
        "the most expensive operators",
    )
    grad_clip: float = Field(
        1.0,
        ge=0,
        description="gradient-norm threshold: of all gradients (norm), of each optimizer group (group_norm), "
        "during train.adaptive_clip.warmup (adaptive); 0: off",
    )
    clip_mode: Literal["norm", "value", "group_norm", "adaptive"] = Field(
        "norm",
        description="gradient clipping: norm (global norm), value (each element to "
        "+-train.value_clip.limit), group_norm (each optimizer group's norm), adaptive "
        "(train.adaptive_clip.factor x running mean of recent norms)",
    )
    seed: int = Field(1337, description="seed for init, data order and sampling")
    sample_tokens: int = Field(120, ge=0, description="tokens sampled at the end of training (0: none)")
    sample_prompt: str | None = Field(
        None, description="prompt of the end-of-training sample (default: the start of a validation document)"
    )
    value_clip: ValueClipConfig = Field(
        default_factory=ValueClipConfig, description='used when train.clip_mode = "value"'
    )
    adaptive_clip: AdaptiveClipConfig = Field(
        default_factory=AdaptiveClipConfig, description='used when train.clip_mode = "adaptive"'
    )
    batch_schedule: BatchScheduleConfig = Field(
        default_factory=BatchScheduleConfig,
        description="the global batch over the run: constant, a ramp, or grown with the gradient noise scale",
    )

    @model_validator(mode="after")
    def _clip(self) -> TrainConfig:
        check_activation_checkpointing(self.activation_checkpointing)
        if self.micro_batch_size != "auto" and self.micro_batch_size < 1:
            raise ValueError('train.micro_batch_size: give at least 1 sequence, or "auto"')
        if self.profile_steps is not None and (
            len(self.profile_steps) != 2 or not 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            raise ValueError("train.profile_steps: give two steps [A, B] with 1 <= A <= B, e.g. [5, 7]")
        if self.early_stop_patience and not self.eval_interval:
            raise ValueError(
                "train.early_stop_patience: needs evaluations to judge; set train.eval_interval above 0"
            )
        if self.clip_mode == "value" and self.value_clip.limit == 0:
            raise ValueError(
                "train.value_clip.limit: clip_mode 'value' needs train.value_clip.limit above 0, e.g. 0.01"
            )
        return self


class MetricsConfig(_Section):
    """What a run measures beyond the per-step record, and where records go besides ``metrics.jsonl`` and
    TensorBoard. Every metric's name and meaning: ``docs/metrics.md``."""

    detail_interval: int = Field(
        50,
        ge=0,
        description="steps between detail records (per-block and per-kind norms, update ratio, activation "
        "RMS, attention entropy on one micro-batch; 0: never)",
    )
    wandb: bool = Field(
        False, description="also log to Weights & Biases in offline mode (RUN/wandb; the wandb extra)"
    )
    wandb_project: str = Field("lmforge", description="the W&B project name of metrics.wandb")


class EvalConfig(_Section):
    """Downstream tasks scored during training on the current weights (``docs/evaluation.md``): each
    score is logged as ``task/<name>/<metric>``, and a score below the best so far by more than
    ``regression_factor`` standard errors is flagged as a ``task_regression`` event."""

    tasks: list[str] = Field(
        default_factory=list,
        description="shipped task names or paths to task specs (.toml / lm-eval .yaml); multiple-choice "
        "and generation tasks (empty: none)",
    )
    interval: int = Field(0, ge=0, description="steps between task evaluations (0: only at the end)")
    limit: int = Field(0, ge=0, description="the first N questions of each task (0: all)")
    batch_size: int = Field(16, ge=1, description="rows per forward pass while scoring tasks")
    regression_factor: float = Field(
        2.0, ge=0, description="flag a score below best - factor x its standard error as a regression"
    )
    keep_best: str = Field(
        "",
        description="a task of eval.tasks (its name, as in task/<name>/...) whose best score's checkpoint is "
        "kept, named in RUN/best_task.json and never rotated away (empty: none)",
    )

    @model_validator(mode="after")
    def _keep_best(self) -> EvalConfig:
        if self.keep_best and not self.tasks:
            raise ValueError(
                f"eval.keep_best: {self.keep_best!r} names a task but eval.tasks is empty; add the task to "
                "eval.tasks or leave eval.keep_best unset"
            )
        return self


class GuardConfig(_Section):
    """Stability guard: skip steps with a non-finite or spiking loss, roll back after repeated ones.

    Each event is a line of ``metrics.jsonl``; the logic is in ``lmforge/train/callbacks/guard.py``.
    """

    enabled: bool = Field(
        True,
        description="skip optimizer steps whose loss or gradient norm is NaN/Inf, and spikes (one host sync per step)",
    )
    spike_sigmas: float = Field(
        6.0,
        ge=0,
        description="a loss above mean + spike_sigmas x std of the recent accepted losses is a spike (0: off)",
    )
    spike_window: int = Field(100, ge=2, description="recent accepted losses kept for the spike statistics")
    spike_min_history: int = Field(20, ge=2, description="accepted losses needed before spikes are detected")
    max_bad_steps: int = Field(
        3, ge=1, description="consecutive skipped steps that trigger a rollback to the last checkpoint"
    )
    max_rollbacks: int = Field(
        3, ge=0, description="rollbacks allowed in a run; one more stops it with an error"
    )
    rollback_lr_factor: float = Field(
        1.0, gt=0, le=1, description="learning-rate multiplier applied at each rollback (1: unchanged)"
    )

    @model_validator(mode="after")
    def _window(self) -> GuardConfig:
        if self.spike_min_history > self.spike_window:
            raise ValueError(
                f"guard.spike_min_history: {self.spike_min_history} exceeds guard.spike_window "
                f"({self.spike_window}); lower it or widen the window"
            )
        return self


class PowerSGDConfig(_Section):
    """PowerSGD gradient compression (Vogels et al. 2019; ``parallel.ddp_comm_hook = "powersgd"``): each
    gradient matrix ``M`` (n x m) is all-reduced as rank-``r`` factors ``P = M Q`` (n x r) and ``Q = M^T P``
    (m x r), ``(n + m) r`` numbers instead of ``n m``, with error feedback and a warm-started ``Q``."""

    rank: int = Field(1, ge=1, description="rank r of the low-rank approximation of each gradient matrix")
    start_step: int = Field(
        2,
        ge=2,
        description="gradient synchronisations all-reduced uncompressed (FP32) before compression starts "
        "(at least 2: DDP rebuilds its buckets after the first)",
    )
    min_compression_rate: float = Field(
        2.0,
        gt=0,
        description="a matrix is compressed only when n m / ((n + m) r) exceeds this; the others (norms, "
        "biases, small matrices) are all-reduced whole",
    )


class ParallelConfig(_Section):
    """How a run spreads over the processes ``torchrun`` starts (one process: every degree 1).

    The degrees form one DeviceMesh ``(pp, dp_replicate, dp_shard, tp)`` whose size is the world size.
    Data parallelism: ``dp_replicate`` copies (DDP; across groups of hybrid sharding) times ``dp_shard``
    shards; how the shards are cut is ``parallel.zero``. Layouts and the machinery behind each stage:
    docs/parallelism.md.
    """

    dp_replicate: int = Field(
        1, ge=1, description="data-parallel replicas: DDP, or the replicate groups of hybrid sharding"
    )
    dp_shard: int = Field(
        1, ge=1, description="data-parallel ranks that shard the model states among them (see parallel.zero)"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel degree (heads, MLP width and vocabulary split)")
    ep: int = Field(
        1,
        ge=1,
        description="expert-parallel degree (model.moe): each MoE layer's routed experts split among ep of "
        "the data-parallel ranks, tokens sent to their experts' rank by all-to-all; divides dp_replicate x "
        "dp_shard and model.moe.experts",
    )
    pp: int = Field(1, ge=1, description="pipeline stages (ranks), the model cut by layers")
    zero: Literal[1, 2, 3] = Field(
        3,
        description="how dp_shard shards: 1 optimizer states (DDP + ZeroRedundancyOptimizer), 2 also "
        "gradients (FSDP2, parameters kept after forward), 3 also parameters (FSDP2 full sharding)",
    )
    offload: bool = Field(
        False, description="keep sharded parameters, gradients and optimizer states in host memory (FSDP2)"
    )
    defer_grad_sync: bool = Field(
        False,
        description="FSDP2 (dp_shard > 1, zero 2 or 3, no pp) with accumulation: keep unsharded FP32 "
        "gradients over a step's micro-batches and reduce-scatter them once per step (more memory, fewer "
        "collectives; with one micro-batch per step it changes nothing)",
    )
    ddp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = Field(
        "none",
        description="DDP gradient compression (a torch communication hook; DDP and ZeRO-1 only): none "
        "(FP32 all-reduce), bf16 / fp16 (gradients cast to 16 bits, averaged, cast back: half the bytes), "
        "powersgd (low-rank factors with error feedback: parallel.powersgd)",
    )
    powersgd: PowerSGDConfig = Field(
        default_factory=PowerSGDConfig, description='used when parallel.ddp_comm_hook = "powersgd"'
    )
    max_memory_gb: float | None = Field(
        None,
        gt=0,
        description="per-device memory in GB (1e9 bytes) the run must fit: a layout whose planned peak "
        "(lmforge estimate's, the larger of the build and a training step) exceeds it is refused before any "
        "work (unset: the device's memory on CUDA, nothing checked on CPU)",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"] = Field(
        "1f1b", description="pipeline schedule"
    )
    pp_microbatches: int = Field(
        0,
        ge=0,
        description="pipeline micro-batches per train.micro_batch_size batch (0: pp x stages per rank)",
    )
    pp_stages_per_rank: int = Field(
        0, ge=0, description="model chunks per pipeline rank (0: 2 for the interleaved schedules, else 1)"
    )


PARAM_KINDS = {"embedding", "matrix", "norm", "bias"}


class SGDConfig(_Section):
    """Settings of ``optim.name = "sgd"``."""

    momentum: float = Field(0.9, ge=0, lt=1, description="momentum")
    nesterov: bool = Field(False, description="Nesterov momentum")


class MuonConfig(_Section):
    """Settings of the Muon half of ``optim.name = "muon"`` (the AdamW half uses the common keys)."""

    lr: float | None = Field(
        None,
        gt=0,
        description="peak lr of the Muon matrices (default: 0.02, or optim.lr with scale = moonlight)",
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="momentum of the Muon matrices")
    nesterov: bool = Field(True, description="Nesterov momentum")
    ns_steps: int = Field(
        5, ge=1, le=50, description="Newton-Schulz iterations (quintic, in BF16) per update"
    )
    scale: Literal["none", "original", "mup", "moonlight"] = Field(
        "original",
        description="update scale per (d_out, d_in) matrix: none 1, original max(1, d_out/d_in)^0.5, "
        "mup (d_out/d_in)^0.5, moonlight 0.2 max(d_out, d_in)^0.5 (matches AdamW's update RMS)",
    )


class SOAPConfig(_Section):
    """Settings of ``optim.name = "soap"`` (Adam's betas, eps and weight decay are the common keys);
    formula in ``lmforge/optim/soap.py``."""

    precondition_frequency: int = Field(
        10, ge=1, description="steps between refreshes of the eigenbases (one QR step each; the paper: 10)"
    )
    shampoo_beta: float | None = Field(
        None, ge=0, lt=1, description="EMA beta of the Kronecker factors L, R (default: optim.betas[1])"
    )
    max_precond_dim: int = Field(
        10000,
        ge=1,
        description="largest matrix dimension given a factor: a longer side is not rotated, a matrix with "
        "both sides longer takes AdamW",
    )


class GradNoiseConfig(_Section):
    """Gradient noise (Neelakantan et al. 2015); formula in ``lmforge/optim/grad_transforms.py``."""

    eta: float = Field(
        0.0,
        ge=0,
        description="noise variance at step 0, eta / (1 + t)^gamma after (0: off; the paper: 0.01-1)",
    )
    gamma: float = Field(0.55, ge=0, description="decay exponent of the noise variance (the paper: 0.55)")


class DepthDecayConfig(_Section):
    """Weight decay by depth: a multiplier linear in depth (0: embeddings .. L + 1: final norm and head)."""

    first: float = Field(1.0, ge=0, description="weight-decay multiplier at depth 0 (the embeddings)")
    last: float = Field(
        1.0,
        ge=0,
        description="weight-decay multiplier at depth L + 1 (final norm, untied head); linear between",
    )


class OptimConfig(_Section):
    name: Literal["adamw", "adam", "sgd", "lion", "adafactor", "adamw8bit", "muon", "soap"] = Field(
        "adamw",
        description="adamw (decoupled decay), adam and sgd (L2 decay), lion (use ~3-10x lower lr), adafactor, "
        "adamw8bit (block-wise 8-bit moments, torchao), muon (hidden matrices; AdamW for the rest), "
        "soap (Adam in the eigenbasis of Shampoo's factors for matrices; AdamW for the rest)",
    )
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay of matrices")
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam betas")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon")
    decay_embeddings: bool = Field(False, description="apply weight decay to embeddings")
    fused: bool | None = Field(
        None, description="fused Adam/AdamW kernel (default: where the device supports it)"
    )
    group_lr_mult: dict[str, float] = Field(
        default_factory=dict, description="learning-rate multiplier per kind: embedding, matrix, norm, bias"
    )
    group_weight_decay: dict[str, float] = Field(
        default_factory=dict, description="weight decay per kind (overrides weight_decay / decay_embeddings)"
    )
    layer_lr_decay: float = Field(
        1.0,
        gt=0,
        le=1,
        description="layer-wise lr decay: each layer below the output gets this factor more (1: off)",
    )
    depth_decay: DepthDecayConfig = Field(
        default_factory=DepthDecayConfig, description="weight decay scaled linearly with depth (1, 1: off)"
    )
    cautious_weight_decay: bool = Field(
        False,
        description="decay only coordinates whose update has the parameter's sign (Chen et al. 2025; "
        "decoupled-decay optimizers)",
    )
    grad_centralization: bool = Field(
        False, description="subtract each row's mean from 2-D weight gradients (Yong et al. 2020)"
    )
    grad_noise: GradNoiseConfig = Field(
        default_factory=GradNoiseConfig, description="Gaussian noise added to gradients after clipping"
    )
    sgd: SGDConfig = Field(default_factory=SGDConfig, description='used when optim.name = "sgd"')
    muon: MuonConfig = Field(default_factory=MuonConfig, description='used when optim.name = "muon"')
    soap: SOAPConfig = Field(default_factory=SOAPConfig, description='used when optim.name = "soap"')

    @model_validator(mode="after")
    def _betas(self) -> OptimConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError("optim.betas: both betas must be in [0, 1)")
        for field in ("group_lr_mult", "group_weight_decay"):
            bad = set(getattr(self, field)) - PARAM_KINDS
            if bad:
                raise ValueError(
                    f"optim.{field}: unknown kind {sorted(bad)[0]!r}; kinds are {', '.join(sorted(PARAM_KINDS))}"
                )
        if self.name == "sgd" and self.sgd.nesterov and self.sgd.momentum == 0:
            raise ValueError("optim.sgd.nesterov: Nesterov needs optim.sgd.momentum above 0")
        if self.name == "muon" and self.muon.nesterov and self.muon.momentum == 0:
            raise ValueError("optim.muon.nesterov: Nesterov needs optim.muon.momentum above 0")
        if self.cautious_weight_decay and self.name in ("adam", "sgd"):
            raise ValueError(
                f"optim.cautious_weight_decay: {self.name} adds decay to the gradient (L2); cautious decay "
                "needs decoupled decay: adamw, lion, adafactor, adamw8bit, muon or soap"
            )
        return self


class WSDConfig(_Section):
    """Settings of warmup-stable-decay (``schedule.name = "wsd"``)."""

    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="share of train.steps spent decaying at the end"
    )
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = Field("1-sqrt", description="shape of the decay")


class StepConfig(_Section):
    """Settings of ``schedule.name = "step"``."""

    step_size: int = Field(1000, ge=1, description="steps between multiplications by gamma")
    gamma: float = Field(0.5, gt=0, le=1, description="multiplier applied every step_size steps")


class PolynomialConfig(_Section):
    """Settings of ``schedule.name = "polynomial"``."""

    power: float = Field(2.0, gt=0, description="exponent of (1 - progress)")


class CyclicConfig(_Section):
    """Settings of ``schedule.name = "cyclic"``."""

    cycle_steps: int = Field(400, ge=2, description="steps of one full triangle (up and down)")


class OneCycleConfig(_Section):
    """Settings of ``schedule.name = "one_cycle"``."""

    div_factor: float = Field(25.0, ge=1, description="the rise starts at peak / div_factor")


class PlateauConfig(_Section):
    """Settings of ``schedule.name = "plateau"``."""

    patience: int = Field(2, ge=0, description="evaluations without improvement before a cut")
    factor: float = Field(0.5, gt=0, lt=1, description="multiplier of each cut")
    threshold: float = Field(1e-3, ge=0, description="relative improvement that counts")


class ScheduleConfig(_Section):
    """Learning-rate schedule; formulas in ``lmforge/optim/schedules.py``."""

    name: Literal[
        "constant",
        "linear",
        "cosine",
        "wsd",
        "step",
        "polynomial",
        "exponential",
        "inverse_sqrt",
        "cyclic",
        "one_cycle",
        "plateau",
    ] = Field("cosine", description="schedule after warmup")
    warmup: int | float = Field(
        80,
        ge=0,
        description="linear warmup: steps, or a fraction of train.steps when below 1 (one_cycle: rise)",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="final (or floor) learning rate as a fraction of the peak"
    )
    wsd: WSDConfig = Field(default_factory=WSDConfig, description='used when schedule.name = "wsd"')
    step: StepConfig = Field(default_factory=StepConfig, description='used when schedule.name = "step"')
    polynomial: PolynomialConfig = Field(
        default_factory=PolynomialConfig, description='used when schedule.name = "polynomial"'
    )
    cyclic: CyclicConfig = Field(
        default_factory=CyclicConfig, description='used when schedule.name = "cyclic"'
    )
    one_cycle: OneCycleConfig = Field(
        default_factory=OneCycleConfig, description='used when schedule.name = "one_cycle"'
    )
    plateau: PlateauConfig = Field(
        default_factory=PlateauConfig, description='used when schedule.name = "plateau"'
    )

    @model_validator(mode="after")
    def _warmup(self) -> ScheduleConfig:
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise ValueError("schedule.warmup: give a whole number of steps, or a fraction below 1")
        if self.name == "exponential" and self.min_lr_ratio == 0:
            raise ValueError("schedule.min_lr_ratio: exponential decay needs a ratio above 0")
        return self


class LRFindConfig(_Section):
    """``lmforge lr-find``: an exponential learning-rate sweep; rules in ``lmforge/plan/lr_finder.py``."""

    start_lr: float = Field(1e-6, gt=0, description="learning rate of the first sweep step")
    end_lr: float = Field(1.0, gt=0, description="learning rate of the last sweep step")
    steps: int = Field(100, ge=5, description="optimizer steps of the sweep (the rate grows geometrically)")
    smoothing: float = Field(
        0.9, ge=0, lt=1, description="beta of the bias-corrected exponential moving average of the loss"
    )
    diverge_factor: float = Field(
        4.0, gt=1, description="stop once the smoothed loss exceeds this factor times its minimum"
    )

    @model_validator(mode="after")
    def _range(self) -> LRFindConfig:
        if self.end_lr <= self.start_lr:
            raise ValueError(
                f"lr_find.end_lr: {self.end_lr:g} must be above lr_find.start_lr ({self.start_lr:g})"
            )
        return self


class DPOConfig(_Section):
    beta: float = Field(0.1, gt=0, description="strength of the pull towards the reference model")
    loss: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid", description="sigmoid (the DPO paper's), ipo (squared, target 1/(2 beta)) or hinge"
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="assumed share of flipped preference labels (sigmoid and hinge)"
    )
    reference: Literal["cached", "model"] = Field(
        "cached",
        description="cached: the starting model's log-probabilities of every pair, computed once and kept "
        "in the run folder; model: a frozen copy of the starting model scores each batch",
    )


class RLConfig(_Section):
    """RL from rewards (``posttrain/rl.py``, docs/post-training.md): completions sampled per prompt, scored by
    a reward, a clipped policy-gradient loss with a KL penalty to the starting model."""

    algorithm: Literal["grpo", "rloo", "ppo"] = Field(
        "grpo",
        description="grpo: group-normalised advantages (r - mean) / (std + eps); rloo: leave-one-out baseline "
        "r_i - mean of the other G-1, on whole sequences; ppo: a value head, per-token rewards with the KL "
        "penalty, GAE advantages (posttrain/ppo.py)",
    )
    loss: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "grpo",
        description="grpo's token-loss aggregation: grpo (per-sequence mean, then mean), dr_grpo (no std in "
        "the advantage, token sum / (G x max_new_tokens)), dapo (token mean over each group); rloo: unused",
    )
    group_size: int = Field(8, description="completions sampled per prompt (G, at least 2)")
    max_new_tokens: int = Field(16, ge=1, description="tokens sampled per completion at most")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the completions")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1: off)")
    beta: float = Field(
        0.04,
        ge=0,
        description="weight of KL(policy || reference): k3 estimator in the loss; ppo: k1 per token in the reward",
    )
    clip_epsilon: float = Field(0.2, gt=0, description="PPO clip range of the importance ratio: 1 +- eps")
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="passes over each rollout batch (GRPO's mu): its completions, old log-probabilities "
        "(ppo: values, advantages) are computed once when it is drawn, then trained on for ppo_epochs x "
        "mini_batches optimizer steps; 1 with mini_batches 1: each rollout trained on once (ratio 1)",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="optimizer steps per pass over a rollout batch: a rollout batch holds mini_batches "
        "steps' prompts (each step's batch: train.tokens_per_step), all sampled from the weights of its "
        "first step, one mini-batch a step",
    )
    gae_gamma: float = Field(
        1.0, ge=0, le=1, description="ppo: discount gamma of the per-token rewards in GAE"
    )
    gae_lambda: float = Field(
        0.95,
        ge=0,
        le=1,
        description="ppo: GAE's lambda (1: Monte-Carlo returns minus values, 0: one-step TD)",
    )
    value_coef: float = Field(0.1, ge=0, description="ppo: weight of the value loss added to the policy loss")
    value_clip: float = Field(
        0.2, gt=0, description="ppo: the values' clip range around those at sampling: V_old +- value_clip"
    )
    whiten_advantages: bool = Field(
        True,
        description="ppo: advantages shifted and scaled to mean 0, variance 1 over the completion tokens "
        "of each micro-batch (the same rows in every data-parallel layout)",
    )
    reward: str = Field(
        "lmforge.posttrain.rewards:addition",
        description="module:function called on (prompt, completion) text, returning a number; or run:PATH, a "
        "reward run of lmforge reward (with the policy's tokenizer) scoring prompt + completion",
    )
    reward_timeout: float = Field(5.0, gt=0, description="seconds one reward call may take")
    reward_workers: int = Field(2, ge=1, description="processes of the reward sandbox")
    failed_reward: float = Field(0.0, description="reward of a sample whose reward call raised or timed out")
    template: Literal["chat", "none"] = Field(
        "chat",
        description="chat: a prompt is a user turn of the chat template, completions stop at <|end|>; none: "
        "the prompt text after <|endoftext|>, completions stop at <|endoftext|>",
    )


class RewardConfig(_Section):
    """The reward model of ``lmforge reward`` (``posttrain/reward.py``, docs/post-training.md)."""

    margin: float = Field(
        0.0,
        description="the margin m of the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - m) for "
        "pairs whose record has no margin field (0: the plain loss)",
    )


class PostTrainConfig(_Section):
    train_files: list[str] = Field(
        default_factory=list,
        description="JSONL records: SFT (instruction/input/output, messages, prompt/completion) or DPO "
        "pairs (prompt/chosen/rejected, plain or chat)",
    )
    val_files: list[str] = Field(default_factory=list, description="held-out records, same formats")
    packing: Literal["pack", "pad"] = Field(
        "pack",
        description="pack: examples back to back in data.seq_len rows with document masks; pad: one "
        "example a row (DPO always pads)",
    )
    over_length: Literal["skip", "truncate"] = Field(
        "skip",
        description="an example longer than data.seq_len: skip (counted and reported with file:line) or "
        "truncate (cut its end to fit)",
    )
    system_prompt: str | None = Field(None, description="a system turn put before records that have none")


class LoraConfig(_Section):
    rank: int = Field(
        0,
        ge=0,
        description="adapter rank r; 0: no LoRA (every parameter trains). lmforge sft/dpo --lora.rank=8",
    )
    alpha: float = Field(16.0, gt=0, description="the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (training only)")
    targets: str = Field(
        "q_proj,v_proj",
        description="the linear layers that get adapters: comma-separated names (a layer matches by its "
        "last name, or by a dotted suffix such as attn.q_proj), or all-linear (every linear layer of the "
        "blocks, not the output head)",
    )
    quantize: Literal["none", "nf4"] = Field(
        "none",
        description="QLoRA: nf4 keeps the frozen weights of the target layers in torchao's 4-bit NF4 "
        "(one process; the adapters stay in full precision)",
    )


class QATConfig(_Section):
    """Quantization-aware training (``model/qat.py``, docs/memory.md): the linear layers of the blocks
    fake-quantize their weights (and activations) in every forward from ``start_step`` on, so training
    sees the error of the integer model ``lmforge export --quantize`` writes."""

    enabled: bool = Field(False, description="fake-quantize the blocks' linear layers during training")
    scheme: Literal["int8da-int4w", "int4w", "int8da-int8w", "int8w"] = Field(
        "int8da-int4w",
        description="int8da-int4w: int8 dynamic per-token activations + int4 per-group weights; int4w: "
        "int4 weights only; int8da-int8w / int8w: the same with int8 weights (torchao, runs on CPU)",
    )
    group_size: int = Field(
        32,
        ge=0,
        description="input columns sharing one weight scale; every linear layer's input width must be a "
        "multiple of it; 0: one scale per output row",
    )
    start_step: int = Field(
        0, ge=0, description="the first optimizer step that trains fake-quantized (before it: full precision)"
    )


class Config(_Section):
    """A training recipe. Each field is a section (``[model]``, ...); a section's settings that belong to
    one choice (a schedule, an optimizer, a clipping mode) sit in a sub-table named after the choice."""

    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="the network: what is learned (vocab_size comes from the tokenizer)",
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="inputs, tokenizer, sequences, domain mixture and curriculum"
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="how the run executes: steps, batch, precision, device, kernels, intervals, clipping",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and its parameter groups")
    schedule: ScheduleConfig = Field(
        default_factory=ScheduleConfig,
        description="learning-rate schedule (formulas: lmforge/optim/schedules.py)",
    )
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="stability guard: skip non-finite or spiking steps, roll back after repeated ones",
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="layout over torchrun processes: data, tensor and pipeline parallel degrees",
    )
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="detail metrics (norms per block, update ratio, activations, attention entropy) and sinks",
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="downstream tasks during training: scores in metrics.jsonl, regressions flagged",
    )
    lr_find: LRFindConfig = Field(
        default_factory=LRFindConfig, description="lmforge lr-find: the exponential learning-rate sweep"
    )
    posttrain: PostTrainConfig = Field(
        default_factory=PostTrainConfig,
        description="records of lmforge sft and dpo: files, packing, over-length examples",
    )
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="the preference loss of lmforge dpo")
    rl: RLConfig = Field(default_factory=RLConfig, description="sampling, reward and loss of lmforge rl")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA / QLoRA adapters: the model frozen, low-rank updates of chosen linear layers train",
    )
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="the reward model of lmforge reward: its loss's margin"
    )
    qat: QATConfig = Field(
        default_factory=QATConfig,
        description="quantization-aware training: fake-quantized linear layers for an INT8 / INT4 export",
    )


# What a fine-tuning run changes from lmforge's (pretraining) defaults; a recipe and flags override them.
POSTTRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {
        "train.steps": 300,
        "optim.lr": 3e-4,
        "schedule.warmup": 20,
        "train.eval_interval": 50,
        "train.checkpoint_interval": 100,
        "train.eval_tokens": 1 << 30,  # every held-out example
    },
    "dpo": {
        "train.steps": 200,
        "optim.lr": 5e-5,
        "optim.weight_decay": 0.0,
        "schedule.warmup": 10,
        "train.eval_interval": 50,
        "train.checkpoint_interval": 100,
        "train.eval_tokens": 1 << 30,
    },
    "rl": {
        "train.steps": 100,
        "optim.lr": 1e-4,
        "optim.weight_decay": 0.0,
        "schedule.warmup": 5,
        "train.eval_interval": 25,
        "train.checkpoint_interval": 50,
        "train.eval_tokens": 1 << 30,
        # the RL loss (advantage-weighted surrogate + beta x KL) measures no quality: a batch whose
        # completions differ much in reward, or a growing KL, raises it. Spike detection would skip
        # exactly those updates (and roll back after three); non-finite steps are still skipped.
        "guard.spike_sigmas": 0.0,
    },
    "reward": {
        "train.steps": 200,
        "optim.lr": 1e-4,
        "optim.weight_decay": 0.0,
        "schedule.warmup": 10,
        "train.eval_interval": 50,
        "train.checkpoint_interval": 100,
        "train.eval_tokens": 1 << 30,
        "train.sample_tokens": 0,  # a reward model scores; its language-model head is not trained
    },
}


# -- checks of a recipe that span sections (beside the config they read, before any work) ----------------


def min_capacity_factor(tokens: int, k: int, experts: int) -> float:
    """The smallest ``capacity_factor`` that leaves each expert one slot: ``floor(f T k / E) >= 1`` holds
    exactly when ``f >= E / (T k)`` (``T`` tokens of a training micro-batch on one rank)."""
    return experts / (tokens * k)


def check_moe(cfg: Config, chunks: int = 1) -> None:
    """An MoE recipe (``model/moe.py``) against what the layer supports, before any work (one line naming the key):
    ``parallel.ep`` dividing the experts, expert groups inside one pipeline stage, capacity for at least
    one token per expert in each of the ``chunks`` parts a micro-batch runs as (a pipeline's microbatches,
    computed by ``parallel/model_layout.py``), and no mode it does not
    handle yet (the zero-bubble pipeline schedules, FP8, DPO)."""
    m, ep = cfg.model.moe, cfg.parallel.ep
    if ep > 1 and not m.experts:
        raise ConfigError(
            f"parallel.ep: {ep} splits the experts of MoE layers, and this model has none; set "
            "model.moe.experts or parallel.ep = 1"
        )
    if not m.experts:
        return
    if m.experts % ep:
        raise ConfigError(
            f"parallel.ep: {ep} does not divide model.moe.experts ({m.experts}); choose an ep that divides the "
            "number of experts"
        )
    dp = cfg.parallel.dp_replicate * cfg.parallel.dp_shard
    if ep > 1 and cfg.parallel.pp > 1 and dp % ep:
        raise ConfigError(
            f"parallel.ep: an expert group of {ep} ranks would span pipeline stages (each of the "
            f"parallel.pp = {cfg.parallel.pp} stages has dp_replicate x dp_shard = {dp} ranks); set "
            f"--parallel.dp_shard to a multiple of {ep} so every expert group sits inside one stage"
        )
    if cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in ("zero_bubble", "zbv"):
        raise ConfigError(
            f"parallel.pp_schedule: {cfg.parallel.pp_schedule} splits the backward into input and weight "
            "gradients, which MoE balance losses are not verified under; use gpipe, 1f1b or "
            "interleaved_1f1b with model.moe"
        )
    mbs = cfg.train.micro_batch_size
    if m.capacity_factor and mbs != "auto":
        tokens = mbs * cfg.data.seq_len // chunks
        least = min_capacity_factor(tokens, m.top_k, m.experts)
        if m.capacity_factor < least:
            raise ConfigError(
                f"model.moe.capacity_factor: {m.capacity_factor:g} leaves each expert floor(factor x {tokens} "
                f"tokens x top_k {m.top_k} / {m.experts} experts) = 0 slots per micro-batch; use at least "
                f"{least:.4g} (experts / (tokens x top_k)), or 0 for dropless routing"
            )
    refused = {
        "train.precision": (
            cfg.train.precision == "fp8",
            "fp8 converts linear layers, not the experts' grouped weights; use bf16 with model.moe",
        ),
        "train.objective": (
            cfg.train.objective == "dpo",
            "dpo does not add MoE balance losses yet; use lm or sft",
        ),
    }
    for key, (bad, fix) in refused.items():
        if bad:
            raise ConfigError(f"{key}: with model.moe.experts > 0, {fix}")
