"""What the data-, model- and tensor-parallel planner pages draw: pure functions of the pages' inputs, built on
lmforge's own formulas (``plan/comm.py`` for collective sizes, ``plan/memory.py`` for parameter counts,
``parallel/pipeline.py`` for the layer split and the bubble). Each returns a JSON-ready dict; the browser
only draws it. Bad input raises :class:`~lmforge.errors.UserError` naming the query parameter.

Sizes are the bytes one GPU *sends* in a ring collective (it receives as much), as in ``plan/comm.py``:
all-reduce ``2 (n - 1)/n * X``, reduce-scatter and all-gather ``(n - 1)/n * X`` each.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import UserError
from lmforge.plan import comm, models
from lmforge.plan.memory import param_count

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
MODEL_CHOICES: tuple[str, ...] = (*models.MODELS, "custom")
CHECK_MAX_DIM = 512  # the torch check of the tensor-parallel page multiplies matrices at most this large


def model_params(model: str, custom_millions: float) -> int:
    """Parameters of a named size (``plan.memory.param_count`` of ``plan.models``; tied weights once), or
    ``round(custom_millions * 1e6)`` for ``custom``."""
    if model == "custom":
        if not custom_millions > 0:
            raise UserError(f"params_m: {custom_millions} must be > 0 (millions of parameters)")
        return round(custom_millions * 1e6)
    named = models.get(model)
    return param_count(named.model, named.vocab_size, named.seq_len)


def ring_all_reduce_steps(n: int) -> list[dict[str, Any]]:
    """The ring all-reduce of a buffer cut into ``n`` chunks over ``n`` GPUs, step by step: ``n - 1``
    reduce-scatter steps (at step ``s`` GPU ``i`` sends its running sum of chunk ``(i - s) mod n`` to GPU
    ``i + 1``, which adds it) then ``n - 1`` all-gather steps (GPU ``i`` sends the finished chunk
    ``(i + 1 - s) mod n``). After the reduce-scatter GPU ``i`` holds the full sum of chunk ``(i + 1) mod n``.
    Each step every GPU sends one chunk (``X / n`` bytes), ``2 (n - 1)`` chunks in all:
    ``comm.all_reduce(X, n)``."""
    steps = []
    for phase, offset in (("reduce-scatter", 0), ("all-gather", 1)):
        for s in range(n - 1):
            sends = [{"src": i, "dst": (i + 1) % n, "chunk": (i + offset - s) % n} for i in range(n)]
            steps.append({"phase": phase, "step": s, "sends": sends})
    return steps


def data_parallel(gpus: int, batch: int, model: str, grad_dtype: str, custom_millions: float = 100.0) -> dict:
    """Data parallelism (DDP): the global ``batch`` split into ``batch / gpus`` samples per GPU, a full
    replica of the model on each, then one all-reduce of the gradients, ``P * g`` bytes (``g`` the
    gradient dtype's bytes): each GPU sends ``comm.all_reduce(P g, n) = 2 (n - 1)/n * P g``, half in the
    reduce-scatter and half in the all-gather (``comm.reduce_scatter`` / ``comm.all_gather``).
    ``lmforge_ddp_bytes`` is ``comm.dp_volume("ddp", P, n, ...)``: lmforge reduces FP32 gradients
    (``g = 4``), what ``lmforge estimate`` reports as ``comm.dp`` for ``--parallel.dp_replicate=n``."""
    if batch % gpus:
        raise UserError(f"batch: {batch} is not divisible by gpus={gpus}; give a multiple of {gpus}")
    if grad_dtype not in DTYPE_BYTES:
        raise UserError(f"grad_dtype: {grad_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    params = model_params(model, custom_millions)
    g = DTYPE_BYTES[grad_dtype]
    grad_bytes = float(params * g)
    return {
        "gpus": gpus,
        "batch": batch,
        "micro_batch": batch // gpus,
        "params": params,
        "grad_bytes": grad_bytes,
        "chunk_bytes": grad_bytes / gpus,
        "reduce_scatter_bytes": comm.reduce_scatter(grad_bytes, gpus),
        "all_gather_bytes": comm.all_gather(grad_bytes, gpus),
        "all_reduce_bytes": comm.all_reduce(grad_bytes, gpus),
        "lmforge_ddp_bytes": comm.dp_volume("ddp", params, gpus, g),
        "ring_steps": ring_all_reduce_steps(gpus),
    }


def model_parallel(layers: int, gpus: int, batch: int, seq: int, d_model: int, dtype_bytes: int) -> dict:
    """Naive layer-wise model parallelism: ``parallel.pipeline.stage_layers(layers, gpus)`` gives each GPU
    a contiguous block of layers; one batch goes forward GPU 0 -> GPU n-1 and backward n-1 -> 0, so one
    GPU works at a time. At each of the ``n - 1`` boundaries the activation ``b x T x d`` goes forward and
    its gradient comes back, ``b T d c`` bytes each way: ``comm.pp_volume(n, b T, d, c) = 2 b T d c`` per
    boundary and step. The timeline takes a layer's backward as twice its forward; GPU ``s`` is busy
    ``L_s / L`` of the step, so the mean idle fraction is ``1 - 1/n = (n - 1)/n``,
    ``parallel.pipeline.bubble_fraction(n, 1)``."""
    from lmforge.parallel.pipeline import bubble_fraction, stage_layers

    if layers < gpus:
        raise UserError(f"gpus: cannot cut {layers} layers into {gpus} stages; give gpus <= layers")
    stages = stage_layers(layers, gpus)
    tokens = batch * seq
    activation = float(tokens * d_model * dtype_bytes)
    boundary = comm.pp_volume(gpus, tokens, d_model, dtype_bytes)
    # timeline in units of one layer's forward: forward left to right, then backward (2x) right to left
    timeline, t = [], 0.0
    for s, r in enumerate(stages):
        timeline.append({"gpu": s, "pass": "forward", "start": t, "duration": float(len(r))})
        t += len(r)
    for s in reversed(range(gpus)):
        timeline.append({"gpu": s, "pass": "backward", "start": t, "duration": 2.0 * len(stages[s])})
        t += 2 * len(stages[s])
    idle = [1 - 3 * len(r) / t for r in stages]
    return {
        "layers": layers,
        "gpus": gpus,
        "stages": [[r.start, r.stop] for r in stages],
        "activation_bytes": activation,
        "boundary_bytes": boundary,
        "boundaries": gpus - 1,
        "total_bytes": boundary * (gpus - 1),
        "step_time": t,
        "timeline": timeline,
        "idle_per_gpu": idle,
        "idle_mean": sum(idle) / gpus,
        "bubble": bubble_fraction(gpus, 1),
    }


def _check_dims(m: int, k: int, n: int, gpus: int) -> tuple[int, int, int]:
    """The dimensions of the torch check: each capped at ``CHECK_MAX_DIM`` and kept a multiple of
    ``gpus`` (the sharded ones, ``k`` and ``n``)."""

    def cap(x: int, mult: int) -> int:
        return x if x <= CHECK_MAX_DIM else max(mult, CHECK_MAX_DIM // mult * mult)

    return cap(m, 1), cap(k, gpus), cap(n, gpus)


def tp_check(m: int, k: int, n: int, gpus: int, seed: int = 0) -> dict:
    """A real check of the shard algebra with torch in FP32 on random ``X (m x k)``, ``W (k x n)``,
    ``W2 (n x k)``: column-parallel ``cat_i(X W[:, i])``, row-parallel ``sum_i X[:, i] W[i, :]`` and the
    Megatron MLP pair ``sum_i gelu(X W[:, i]) W2[i, :]`` against the unsplit products; the largest absolute
    differences (rounding only: the sums are taken in another order)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(k, n, generator=gen) / k**0.5
    w2 = torch.randn(n, k, generator=gen) / n**0.5
    full = x @ w
    cols = torch.cat([x @ wi for wi in w.chunk(gpus, dim=1)], dim=1)
    rows = sum(xi @ wi for xi, wi in zip(x.chunk(gpus, dim=1), w.chunk(gpus, dim=0), strict=True))
    act = torch.nn.functional.gelu
    mlp = act(full) @ w2
    pair = sum(
        act(x @ w1i) @ w2i for w1i, w2i in zip(w.chunk(gpus, dim=1), w2.chunk(gpus, dim=0), strict=True)
    )
    return {
        "dims": [m, k, n],
        "column_max_diff": float((cols - full).abs().max()),
        "row_max_diff": float((rows - full).abs().max()),
        "mlp_max_diff": float((pair - mlp).abs().max()),
        "scale": float(full.abs().max()),
    }


def tensor_parallel(m: int, k: int, n: int, gpus: int, dtype_bytes: int) -> dict:
    """``Y = X W`` with ``X`` (``m`` tokens x ``k``), ``W`` (``k x n``) over ``t = gpus``:

    * column-parallel: GPU ``i`` keeps ``W_i`` (``k x n/t``) and computes ``Y_i = X W_i`` (``m x n/t``),
      ``2 m k n / t`` FLOPs; the outputs are all-gathered, ``comm.all_gather(m n c, t)`` bytes sent per GPU;
      in backward ``dX = sum_i dY_i W_i^T`` is all-reduced, ``comm.all_reduce(m k c, t)``.
    * row-parallel: GPU ``i`` keeps ``W_i`` (``k/t x n``) and its slice ``X_i`` (``m x k/t``) and computes a
      partial ``X_i W_i`` (``m x n``); the partial sums are all-reduced, ``comm.all_reduce(m n c, t)``;
      backward needs none (``dX_i = dY W_i^T`` is local).
    * the Megatron MLP pair ``gelu(X W) W2`` (``W`` column-, ``W2`` (``n x k``) row-parallel): the
      column output stays sharded into the row layer, so forward needs one all-reduce of ``m x k`` and
      backward one (of ``dX``), ``2 comm.all_reduce(m k c, t)`` in all, which is half of
      ``comm.tp_volume(t, 1, m, k, V, c, head=False)`` for a whole block (attention and MLP), lmforge's
      tensor-parallel plan (there split as all-gather + reduce-scatter with sequence parallelism).
    """
    for name, dim in (("k", k), ("n", n)):
        if dim % gpus:
            raise UserError(f"{name}: {dim} is not divisible by gpus={gpus}; give a multiple of {gpus}")
    c = dtype_bytes
    flops = 2.0 * m * k * n
    ar_mk = comm.all_reduce(m * k * c, gpus)
    return {
        "m": m,
        "k": k,
        "n": n,
        "gpus": gpus,
        "dtype_bytes": c,
        "flops_total": flops,
        "flops_per_gpu": flops / gpus,
        "column": {
            "w_shard": [k, n // gpus],
            "x_shape": [m, k],
            "y_shard": [m, n // gpus],
            "forward_bytes": comm.all_gather(m * n * c, gpus),
            "backward_bytes": ar_mk,
        },
        "row": {
            "w_shard": [k // gpus, n],
            "x_shape": [m, k // gpus],
            "y_shard": [m, n],
            "forward_bytes": comm.all_reduce(m * n * c, gpus),
            "backward_bytes": 0.0,
        },
        "mlp": {
            "forward_all_reduces": 1,
            "backward_all_reduces": 1,
            "forward_bytes": ar_mk,
            "backward_bytes": ar_mk,
            "block_tp_volume": comm.tp_volume(gpus, 1, m, k, 0, c, head=False),
        },
        "check": tp_check(*_check_dims(m, k, n, gpus), gpus),
    }
