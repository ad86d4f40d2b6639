"""The numeric precision policy of a run: one object answers every precision question.

``train.precision`` chooses how matrix products compute; the master weights, the optimizer state and
the gradients the optimizer sees are FP32 in every case but ``fp64``:

* ``fp32``: no autocast. On CUDA, matrix products are IEEE FP32 (TF32 off).
* ``tf32``: FP32 tensors, but CUDA matrix products and cuDNN convolutions use TF32 tensor cores
  (``torch.backends.{cuda.matmul,cudnn.conv}.fp32_precision = "tf32"``, set when the policy is
  resolved and set back to ``"ieee"`` by every other CUDA policy). A CPU has no TF32: one warning, and
  the run computes exactly as ``fp32``.
* ``bf16``: BF16 autocast. BF16 has FP32's exponent range, so no loss scaling.
* ``fp16``: FP16 autocast with dynamic loss scaling (``torch.amp.GradScaler``, ``[train.loss_scale]``):
  :meth:`~PrecisionPolicy.backward` multiplies the loss by the scale, :meth:`~PrecisionPolicy.unscale_`
  divides the gradients by it (and notes whether any is Inf/NaN) before they are measured or clipped,
  and :meth:`~PrecisionPolicy.step` is ``scaler.step`` + ``scaler.update``: an overflowing step is not
  taken and the scale is multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in a
  row it is multiplied by ``growth_factor``. In a multi-process run each rank's "found Inf" is
  all-reduced (MAX, over all ranks) right after unscaling, so under DDP, FSDP2 (sharded gradients: each
  rank sees only its shards), tensor parallelism and hybrid layouts every rank skips the same steps and
  keeps the same scale. (Torch already agrees in part: DDP's gradient all-reduce spreads an Inf/NaN to
  every rank, and the DTensor dispatch of the found-Inf op reduces the flag over the gradient's mesh for
  FSDP2 and TP; measured, FSDP2 agrees without the explicit reduction. It is kept so that agreement
  holds in every layout without relying on either. ``ShardedGradScaler`` does the same reduction but
  keeps its flag in shape ``(1,)``, which torch 2.13's fused AdamW cannot broadcast into its step
  counters; measured failing.) The scaler's state (scale, growth tracker) is in :meth:`state_dict`,
  saved in checkpoints: a resumed run continues with the same scale.
* ``fp8``: torchao's float8 training of the linear layers (``train.fp8_recipe``: ``tensorwise``,
  ``rowwise``, ``rowwise_with_gw_hp``; :func:`convert_fp8`, run by the ``convert`` stage of
  ``lmforge.parallel.apply``, first in the transformation order), BF16 autocast for everything else.
  Layers torchao cannot take (a dimension not a multiple of 16) and the output head stay BF16. Needs a
  GPU of compute capability 8.9 or newer (refused below it, :func:`fp8_refusal`); on a CPU the float8
  matrix products are emulated (``Float8LinearConfig.emulate``: the operands are quantised to float8
  and multiplied in high precision), slow but numerically float8. Under FSDP2 the tensorwise recipe's
  weights are all-gathered in float8 (:func:`convert_fp8` with ``fsdp``; the scales by
  :func:`register_fp8_scale_precompute`), the rowwise recipes' in BF16; under tensor parallelism the
  float8 layers are sharded by ``lmforge/parallel/tensor.py``'s plan (torchao's float8 styles). Measured
  figures: ``docs/parallelism.md``.
* ``fp64``: everything float64: parameters (the FP32 run's initial draws, widened: ``model/init.py``),
  activations, the loss (``model/fused_loss.py`` keeps its softmax and sums in float64 then), gradients,
  their reductions (gloo and NCCL reduce float64) and the optimizer state. For verification: a layout's
  run then equals one process's to ~1e-13 whatever order a CPU's kernels sum in, where FP32 runs differ
  by ~1e-6 and Adam magnifies that (``tests/test_distributed.py``). Refused with AdamW8bit (torchao's
  FP32 moments refuse float64 DTensor parameters); Muon's Newton-Schulz stays BF16. Slow, and on GPUs
  very slow: not for training.
* ``auto`` picks BF16 only where the hardware computes it natively: a CUDA GPU with BF16 support, or a
  CPU with AVX-512-BF16 or AMX tiles. Elsewhere (for example AVX2-only CPUs) BF16 matrix products are
  emulated and run tens of times slower than FP32, so ``auto`` picks FP32 and ``bf16`` warns.

Softmax, norms and the loss stay in FP32 under every autocast, and this holds by construction of the
model rather than by autocast's op lists (measured on CPU, torch 2.13: ``F.rms_norm``, ``F.layer_norm``
and ``torch.softmax`` given BF16/FP16 inputs under CPU autocast compute and return BF16/FP16):

* norms: the residual stream is FP32 (the embedding is not autocast, and ``x + block(x)`` of an FP32
  ``x`` and a BF16/FP16 branch is FP32), so every RMSNorm/LayerNorm, the final one included, gets FP32
  inputs and computes in FP32 (``tests/test_precision.py`` records their input and output dtypes);
* softmax: attention's softmax runs inside ``scaled_dot_product_attention`` on BF16/FP16 ``q, k, v``;
  its kernels accumulate the softmax in FP32 (CPU: the result equals the FP32 computation rounded once,
  relative error 1.5e-3 for BF16 against 8.5e-3 for a BF16 softmax; CUDA's flash / memory-efficient
  kernels and FlexAttention keep the softmax statistics in FP32 registers);
* the loss: ``model/loss.py`` upcasts each chunk's logits with ``.float()`` before the cross-entropy.

A :class:`PrecisionPolicy` is built once per run (:meth:`PrecisionPolicy.resolve`) and answers:

* :meth:`~PrecisionPolicy.autocast`: the context forward passes (training and evaluation) run in;
* :meth:`~PrecisionPolicy.backward`: how a loss is differentiated;
* :meth:`~PrecisionPolicy.unscale_`: what must happen to gradients before they are measured or clipped;
* :meth:`~PrecisionPolicy.overflowed`: whether the scaler found Inf/NaN gradients with a finite loss;
* :meth:`~PrecisionPolicy.step`: how the optimizer step is taken (whether it was taken);
* :meth:`~PrecisionPolicy.discard`: a step vetoed by an observer (the guard) leaves the scaler as it was;
* :attr:`~PrecisionPolicy.eval_dtype`: the dtype evaluation computes in.

Loss scaling and the stability guard (``train/callbacks/guard.py``) agree as follows (``train/step.py``): after
unscaling, a step whose gradients hold Inf/NaN while its loss is finite is an *overflow*: the scaler's
business. It is skipped once (no optimizer step; the scale backs off), the guard is not asked (so it is
neither a ``skip_nonfinite`` nor one of the ``guard.max_bad_steps`` that lead to a rollback), and it is
counted once: one ``loss_scale_overflow`` line in ``metrics.jsonl`` (``loss_scale`` before, ``new_loss_scale`` after)
and one in the run summary's ``skipped_steps`` and ``loss_scale_overflows``. A non-finite *loss* is the
guard's as with any precision (``skip_nonfinite``, counting toward a rollback); the vetoed step leaves
the scale unchanged (:meth:`discard`). With the guard disabled, a step the scaler skips for any reason
is reported as an overflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from lmforge.config import LossScaleConfig, ParallelConfig, TrainConfig
from lmforge.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,  # everything but the converted linear layers
    "fp64": torch.float64,
}
FULL = (torch.float32, torch.float64)  # compute dtypes without autocast (the parameters' own)
FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
FP8_DIVISOR = 16  # torch._scaled_mm needs both dimensions of a weight to be multiples of 16


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies BF16 matrices in hardware."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` where native, else ``fp32``; explicit choices are kept (with a warning if slow)."""
    if requested == "auto":
        chosen = "bf16" if native_bf16(device) else "fp32"
        log.info("precision: auto -> %s (native BF16 on %s: %s)", chosen, device.type, native_bf16(device))
        return chosen
    if requested == "bf16" and not native_bf16(device):
        log.warning(
            "train.precision: bf16 on a %s without native BF16 is emulated and much slower than fp32; "
            "use --train.precision=auto",
            device.type,
        )
    return requested


def fp8_refusal(capability: tuple[int, int]) -> str | None:
    """The one-line refusal of ``fp8`` on a CUDA GPU of compute ``capability``, or None where it can."""
    if tuple(capability) >= FP8_MIN_CAPABILITY:
        return None
    major, minor = capability
    return (
        f"train.precision: fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        f"this one is {major}.{minor}; use --train.precision=bf16"
    )


def check_precision(
    train: TrainConfig,
    parallel: ParallelConfig,
    device: torch.device,
    capability: tuple[int, int] | None = None,
    optimizer: str = "",
) -> None:
    """Refuse (one line naming the key) what this device, layout or ``optimizer`` (``optim.name``) cannot
    do with ``train.precision``, warn where it is slow; ``capability``: the CUDA device's (read from the
    device when None)."""
    name = train.precision
    if name == "fp64" and optimizer == "adamw8bit":
        raise ConfigError(
            "train.precision: fp64 with optim.name = adamw8bit is not supported (its 8-bit moments are "
            "computed in FP32); use --train.precision=fp32 or another optimizer"
        )
    if name == "fp8" and device.type == "cuda":
        refusal = fp8_refusal(capability or torch.cuda.get_device_capability(device))
        if refusal:
            raise ConfigError(refusal)
    if name == "fp16" and parallel.pp > 1:
        raise ConfigError(
            "train.precision: fp16 with parallel.pp > 1 is not supported (the pipeline schedule runs "
            "backward itself, without the loss scale); use --train.precision=bf16"
        )
    if device.type == "cpu" and name == "tf32":
        log.warning("train.precision: tf32 exists only on CUDA GPUs; on this CPU the run computes in fp32")
    elif device.type == "cpu" and name == "fp16":
        log.warning(
            "train.precision: fp16 on a CPU is slow (FP16 matrix products are emulated on most CPUs); "
            "use --train.precision=auto"
        )
    elif device.type == "cpu" and name == "fp8":
        log.warning(
            "train.precision: fp8 on a CPU runs emulated (float8 operands, high-precision products) and "
            "slow; it is for testing, use a GPU of compute capability 8.9+ to train"
        )


def set_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 for FP32 matrix products and cuDNN convolutions on CUDA (torch's ``fp32_precision`` API)."""
    if device.type != "cuda":
        return
    mode = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def make_scaler(cfg: LossScaleConfig, device: torch.device) -> torch.amp.GradScaler:
    """The loss scaler of ``fp16`` with the ``[train.loss_scale]`` settings."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=cfg.init_scale,
        growth_factor=cfg.growth_factor,
        backoff_factor=cfg.backoff_factor,
        growth_interval=cfg.growth_interval,
    )


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The scaler's "found Inf/NaN" flags of ``optimizer``'s last unscaling, one per device: the very
    tensors ``scaler.step`` (and a fused optimizer) read. ``GradScaler`` keeps them in a private record;
    ``ShardedGradScaler`` reads the same one."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


@dataclass(frozen=True)
class PrecisionPolicy:
    """How one run computes: ``name`` is ``fp32``, ``tf32``, ``bf16``, ``fp16`` or ``fp8`` (autocast over
    FP32 master weights); ``scaler``: the dynamic loss scaler of ``fp16`` (None otherwise)."""

    name: str
    device: torch.device
    scaler: torch.amp.GradScaler | None = field(default=None, compare=False)
    distributed: bool = False  # several processes: the scaler's found-Inf is all-reduced over all ranks

    @classmethod
    def resolve(
        cls,
        requested: str,
        device: torch.device,
        loss_scale: LossScaleConfig | None = None,
        distributed: bool = False,
    ) -> PrecisionPolicy:
        """The policy for ``train.precision`` on ``device`` (``auto`` resolved; see the module docstring);
        ``loss_scale``: the ``fp16`` scaler's settings; ``distributed``: several processes."""
        name = resolve_precision(requested, device)
        set_tf32(device, name == "tf32")
        scaler = None
        if name == "fp16":
            scaler = make_scaler(loss_scale or LossScaleConfig(), device)
        return cls(name, device, scaler, distributed)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matrix products run in (``fp8``: that of everything but the float8 linear layers;
        FSDP2 gathers parameters in it)."""
        return DTYPES[self.name]

    @property
    def sum_dtype(self) -> torch.dtype:
        """The dtype a step's losses are summed in: FP32, FP64 under ``fp64``."""
        return torch.promote_types(self.compute_dtype, torch.float32)

    @property
    def eval_dtype(self) -> torch.dtype:
        """The dtype evaluation computes in: the training compute dtype, so validation measures the
        function that was trained."""
        return self.compute_dtype

    @property
    def loss_scale(self) -> float | None:
        """The current loss scale (``fp16``), else None. Reading it is a host sync."""
        return None if self.scaler is None else float(self.scaler.get_scale())

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context forward passes run in: autocast to :attr:`compute_dtype`, nothing for
        fp32/tf32/fp64."""
        if self.compute_dtype in FULL:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Differentiate ``loss`` (gradients accumulate); with a loss scaler, ``loss * scale``."""
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale before they are measured or clipped (a no-op without a
        loss scaler; with one, also notes whether any gradient is Inf/NaN, agreed over all ranks)."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if self.distributed:  # every rank skips the same steps: MAX of the flags over all ranks, in place
            import torch.distributed as dist

            for flag in found_inf(self.scaler, optimizer):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)

    def overflowed(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        """Whether this step is a loss-scale overflow: after :meth:`unscale_`, some gradient is Inf/NaN
        while ``loss`` (already reduced over ranks) is finite. One host sync with a scaler, none without."""
        if self.scaler is None:
            return False
        found = sum(f.to(loss.device) for f in found_inf(self.scaler, optimizer)).reshape(())
        inf, finite = torch.stack([found > 0, torch.isfinite(loss).reshape(())]).tolist()
        return bool(inf and finite)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step; returns whether it was taken (a scaler skips overflowing steps and
        then backs the scale off; it grows it after ``growth_interval`` clean steps)."""
        if self.scaler is None:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        taken = not sum(float(f) for f in found_inf(self.scaler, optimizer))
        self.scaler.update()
        return taken

    def discard(self, optimizer: torch.optim.Optimizer) -> None:
        """An observer vetoed the step (its gradients are dropped): forget this step's unscaling and leave
        the scale and growth tracker as they were. (``GradScaler`` has no public reset short of
        ``update()``, which would count the step; its per-optimizer record is dropped instead.)"""
        if self.scaler is not None:
            self.scaler._per_optimizer_states.pop(id(optimizer), None)

    def state_dict(self) -> dict:
        """The scaler's state (empty without a scaler)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (an empty state, e.g. of a run that had no scaler, keeps the
        configured initial scale)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# -- FP8: the model conversion of the ``convert`` stage, and FSDP2's float8 all-gather ----------------------

# torchao's float8 all-gather (``enable_fsdp_float8_all_gather``) casts each weight shard with one scale
# for the whole weight: tensorwise scaling only (its ``Float8LinearConfig`` asserts tensorwise weight
# granularity; torchao 0.18). The rowwise recipes scale each row, and FSDP2 gathers their weights in BF16.
FLOAT8_ALL_GATHER_RECIPES = frozenset({"tensorwise"})


def fp8_takes(module: nn.Module, fqn: str, tp: int = 1) -> bool:
    """Whether the float8 conversion takes this linear layer: not the output head (its logits feed the
    loss, kept in BF16), and both dimensions multiples of 16 (``torch._scaled_mm``). Under tensor
    parallelism over ``tp`` ranks each rank multiplies a ``1 / tp`` slice of one of the two dimensions
    (output features of a column-parallel layer, input features of a row-parallel one), so both must be
    multiples of ``16 * tp``."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] == "lm_head":
        return False
    divisor = FP8_DIVISOR * tp
    return module.in_features % divisor == 0 and module.out_features % divisor == 0


def float8_all_gather(recipe: str) -> bool:
    """Whether FSDP2 can all-gather the weights of ``train.fp8_recipe = recipe`` in float8 (tensorwise)."""
    return recipe in FLOAT8_ALL_GATHER_RECIPES


def _cpu_autocast_input(module: nn.Module, args: tuple) -> tuple | None:
    """torchao's ``Float8Linear.forward`` copies ``F.linear``'s autocast cast of its input for CUDA
    autocast only; this forward pre-hook does the same under CPU autocast (without it the layer keeps an
    FP32 input and ``rowwise_with_gw_hp``'s high-precision weight gradient mixes BF16 and FP32)."""
    if torch.is_autocast_enabled("cpu") and args and args[0].is_floating_point():
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def fp8_config(recipe: str, device: torch.device, fsdp: bool = False):
    """torchao's ``Float8LinearConfig`` of ``recipe``: emulated off CUDA; with ``fsdp`` and a recipe of
    :data:`FLOAT8_ALL_GATHER_RECIPES`, FSDP2 all-gathers the weights in float8."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config,
        emulate=device.type != "cuda",
        enable_fsdp_float8_all_gather=fsdp and float8_all_gather(recipe),
    )


def convert_fp8(
    model: nn.Module,
    recipe: str,
    device: torch.device,
    fsdp: bool = False,
    tp: int = 1,
    targets: set[str] | None = None,
) -> int:
    """Swap ``model``'s linear layers for torchao ``Float8Linear`` with ``recipe`` (emulated off CUDA);
    returns how many were converted (logged with the skipped ones). ``fsdp``: FSDP2 will shard the model,
    so the weights of a tensorwise recipe are wrapped for its float8 all-gather (then
    :func:`register_fp8_scale_precompute` must be called once the optimizer exists); ``tp``: the
    tensor-parallel degree (:func:`fp8_takes`); ``targets``: the layers FP8 may wrap at all
    (``model/wrap.py::linear_targets``; None: every linear layer). Works on a meta-device model (nothing
    is allocated)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = fp8_config(recipe, device, fsdp)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    def takes(m: nn.Module, fqn: str) -> bool:
        return (targets is None or fqn in targets) and fp8_takes(m, fqn, tp)

    convert_to_float8_training(model, module_filter_fn=takes, config=config)
    converted = [m for m in model.modules() if isinstance(m, Float8Linear)]
    if config.emulate:
        for m in converted:
            m.register_forward_pre_hook(_cpu_autocast_input)
    head = sum(n.rsplit(".", 1)[-1] == "lm_head" for n, _ in linears)
    log.info(
        "fp8: %d of %d linear layers converted to float8 (%s%s); kept in bf16: %d output head, %d with a "
        "dimension not a multiple of %d",
        len(converted), len(linears), recipe, ", emulated" if config.emulate else "", head,
        len(linears) - len(converted) - head, FP8_DIVISOR * tp,
    )  # fmt: skip
    if fsdp and converted and config.enable_fsdp_float8_all_gather:
        for m in converted:
            m.register_state_dict_post_hook(_plain_weight_state)
        log.info("fp8: FSDP2 all-gathers the float8 layers' weights in float8 (%s scaling)", recipe)
    elif fsdp and converted:
        log.info(
            "fp8: FSDP2 all-gathers the weights in bf16 with train.fp8_recipe = %s (torchao's float8 "
            "all-gather takes tensorwise scaling only)",
            recipe,
        )
    return len(converted)


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` without torchao's float8 all-gather wrapper (``WeightWithDynamicFloat8CastTensor``, also
    inside a DTensor): the FP32 values themselves, sharing their storage (a load into it fills the
    parameter); any other tensor unchanged."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if isinstance(weight, DTensor) and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor):
        local = weight._local_tensor._tensor.detach()
        return DTensor.from_local(
            local,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )
    if isinstance(weight, WeightWithDynamicFloat8CastTensor):
        return weight._tensor.detach()
    return weight


def _plain_weight_state(module: nn.Module, state: dict, prefix: str, _metadata: dict) -> None:
    """State-dict post-hook of a float8 layer gathered in float8: its weight as :func:`plain_weight`, so a
    checkpoint holds plain FP32 tensors (any layout, or a process without torchao, can read it; saved as
    torchao's subclass, DCP would pickle the class and loading would need torchao imported)."""
    key = prefix + "weight"
    if key in state:
        state[key] = plain_weight(state[key])


def float8_gathered(model: nn.Module) -> list[nn.Module]:
    """The float8 layers of ``model`` whose weight FSDP2 all-gathers in float8 (a sharded DTensor over
    torchao's ``WeightWithDynamicFloat8CastTensor``)."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [
        m
        for m in model.modules()
        if isinstance(m, Float8Linear)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


def precompute_fp8_scales(model: nn.Module) -> None:
    """The float8 scale of every weight FSDP2 gathers in float8, for its next all-gather (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``): ``scale = max(float8_e4m3fn) / amax(|W|)``, the amaxes
    of all weights reduced in one all-reduce of one vector. Without it each weight's pre-all-gather cast
    reduces its own amax over the data-parallel mesh: one all-reduce per layer and gather, and under
    tensor parallelism a scale per tensor-parallel shard instead of one per weight."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def register_fp8_scale_precompute(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    """Keep the precomputed float8 scales (:func:`precompute_fp8_scales`) of ``model``'s float8-gathered
    weights true to the weights: computed now, after every step of ``optimizer`` (a post-step hook) and
    after every load of ``model``'s state (a ``load_state_dict`` post-hook: a resume, the guard's
    rollback). Every rank must call it (the precompute is a collective). Does nothing (returns False)
    when no weight is gathered in float8."""
    if not float8_gathered(model):
        return False
    precompute_fp8_scales(model)
    optimizer.register_step_post_hook(lambda _optimizer, _args, _kwargs: precompute_fp8_scales(model))
    model.register_load_state_dict_post_hook(lambda _module, _keys: precompute_fp8_scales(model))
    return True
