"""The output head and the cross-entropy fused: ``(hidden, weight, targets) -> loss``, chunk by chunk in
forward and backward, never holding the (tokens x vocabulary) logits or their gradient.

For ``N`` tokens ``x_t`` (rows of ``hidden``), a head ``W`` (``V x d``), logit scale ``s`` (muP's
``1 / width_mult``) and targets ``y_t`` (``-100``: ignored)::

    z_t   = s (x_t W^T)                      logits: in the compute dtype (the product and its scaling,
                                             as the unfused head computes them), the rest in FP32
    lse_t = log sum_j exp(z_tj)
    l_t   = lse_t - z_t,y_t                  (0 where y_t = -100)
    dl_t / dz_tj = p_tj - [j = y_t],         p_tj = exp(z_tj - lse_t)
    dL/dx_t = s g_t (p_t - e_y_t) W,   dL/dW = s sum_t g_t (p_t - e_y_t)^T x_t      (g_t: upstream gradient)

Two reductions: ``"sum"`` (the next-token loss: ``sum_t l_t``, FP32 scalar) and ``"none"`` (``l_t`` per
token, FP32: DPO sums them per sequence). Tokens go ``chunk`` at a time (``0``: all at once), so the
largest temporaries are one chunk's ``chunk x V`` logits in the compute dtype, their FP32 softmax
gradient and its compute-dtype copy for the gradient matmuls. With FP64 matmuls (a float64
verification run, ``train.precision = "fp64"``) every "FP32" below is FP64 (:func:`wide`), so that the
loss and its gradients carry no FP32 rounding.

What is kept for backward (the point of fusing; measured in docs/memory.md), one of two ways:

* recomputing (the per-token loss always; a sum where :func:`precomputes` says no): the hidden states,
  the weight (both alive anyway), the targets and one FP32 log-sum-exp per token. Backward recomputes
  each chunk's logits and turns them into the softmax gradient with the upstream gradient folded in: a
  fourth head matmul per step.
* precomputing (a sum where :func:`precomputes` says yes, as torch's ``linear_cross_entropy`` does: the
  upstream gradient of a sum is one number): forward computes both gradients for an upstream gradient
  of 1, chunk by chunk, and keeps them, the FP32 ``dL/dx`` (``4 N d``) and ``dL/dW`` (``4 V d``);
  backward returns scaled copies (a zero-bubble pipeline schedule runs backward twice on one graph, so
  the kept ones stay). Three head matmuls, as unfused.

Either way the (tokens x vocab) logits and their gradient never exist whole. Precomputing keeps the
gradients where recomputing keeps the input, and needs them twice at once in backward; recomputing
needs them once plus a chunk's temporaries. So precomputing costs no memory at the peak exactly when
the two gradients are no larger than a chunk's backward temporaries, and that is the rule
(:func:`precomputes`): it picks precomputing for the default recipe (where recomputing measured 1.23x
the time of the head and loss, compiled BF16, and 6% fewer training tokens/s: ``benchmarks/fused_loss.py``,
``benchmarks/throughput.py``, figures in docs/memory.md) and recomputing for large models, whose head
gradient outweighs a chunk (a 7B Llama with 32,000 tokens and 2,048-token micro-batches: 0.55 GB
against 0.26 GB), where the extra matmul is under 1% of a step.

Vocabulary parallelism (``group``: the tensor-parallel process group): each rank holds rows
``[vocab_start, vocab_start + V_local)`` of ``W`` and every token's hidden state. Per chunk the row
maxima of the ranks' logits are all-reduced (MAX, FP32), then each rank's sums of ``exp(z - max)`` and
the target logits (0 where the target is not its row) together (SUM, FP64): 20 bytes per token
instead of ``V`` gathered logits. The sums are accumulated in FP64 so that the shards' partial sums
add up to what one process gets for the whole row: the log-sum-exp, and so every softmax value and
the head's gradient, round to the same FP32 numbers as unsharded (measured on 2 ranks: loss and
gradients within 1e-6 of the replicated loss; in FP32 the exponentials' sum held the softmax apart by
an ulp, which AdamW turned into 1.2e-5 of relative parameter difference after 10 steps, against
7.7e-6 for the former gathered logits). ``dL/dx`` is a partial sum over each rank's rows,
all-reduced once (``N x d``, FP32); ``dL/dW`` is this rank's rows.

The element-wise work of a chunk is three kernels (:class:`Kernels`): row maxima, sums of exponentials
and target logits, and the softmax gradient. Run eagerly they are written to allocate little (in-place
ops); :func:`compiled_kernels` gives ``torch.compile``'d ones (one fused pass each) for runs that
compile (``OutputHead.compile_loss``, called by the compile stage of ``parallel/apply.py``). The loop
around them is never traced by an outer ``torch.compile`` (see :func:`linear_cross_entropy`).

Why lmforge's own autograd Function rather than ``torch.nn.functional.linear_cross_entropy`` (torch 2.13,
``LinearCrossEntropyOptions``, a chunked path that precomputes a sum's gradients in forward): (1) it
cannot shard the vocabulary across ranks; (2) on CPU its chunked path runs BF16 inputs through FP32
matmuls (its ``accurate`` policy; the others fall back to it or to emulated BF16 kernels): 5x slower
per head matmul here than BF16 and, for the head and loss of the default recipe (compiled, BF16), 3.5x
slower than this (``benchmarks/fused_loss.py``); (3) it returns the loss (and per-token losses) in the
input dtype, so a BF16 loss sum of thousands of tokens is rounded to 8 significant bits; (4) it always
precomputes a sum's gradients (more memory than recomputing at large vocabularies, above), and by
default its backward consumes them, so a second backward on one graph (zero-bubble pipeline schedules)
fails. In FP32 on one process it measured on par (0.99x the former chunked loss's time against 0.96x
for this one, within the run's noise); one implementation serves every precision and layout instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def chunk_bytes(chunk: int, rows: int, d_model: int, compute_bytes: int) -> int:
    """Bytes of one chunk's softmax gradient with its eager kernels (``rows``: this rank's vocabulary
    rows, ``v``): in FP32 the logits, turned into the gradient in place, ``4 chunk v``; with ``c``-byte
    compute the FP32 logits and their ``c``-byte gradient, or that gradient and its ``c``-byte product for
    the head's gradient: ``max((c + 4) chunk v, c chunk v + c v d)``."""
    if compute_bytes >= 4:
        return 4 * chunk * rows
    c = compute_bytes
    return max((c + 4) * chunk * rows, c * chunk * rows + c * rows * d_model)


def precomputes(tokens: int, rows: int, d_model: int, chunk: int, compute_bytes: int) -> bool:
    """Whether a summed loss computes its gradients in forward: when the two FP32 gradients,
    ``4 (N + v) d`` bytes, are no larger than one chunk's backward temporaries (:func:`chunk_bytes`;
    ``chunk`` 0: all ``N`` tokens at once), so that keeping them from forward to backward raises the
    peak by nothing over recomputing, and saves a head matmul (module docstring)."""
    chunk = min(chunk or tokens, tokens)
    return 4 * (tokens + rows) * d_model <= chunk_bytes(chunk, rows, d_model, compute_bytes)


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the losses and the gradient sums for matmuls in ``dtype``: FP32, or
    FP64 when the matmuls are FP64 (a float64 verification run keeps float64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


def _widen(z: torch.Tensor) -> torch.Tensor:
    return z.to(wide(z.dtype))


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """The largest logit of each row of a chunk ``z`` (this rank's vocabulary rows), FP32 (FP64 for
    FP64 logits)."""
    return _widen(z.amax(dim=1))


def _sum_exp(z, top, local, mine) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_j exp(z_j - top), target logit)`` of each row of a chunk, FP64 (the target logit 0 where
    ``mine`` is false): the exponentials in FP32, their sum accumulated in FP64, so that the shards of a
    row summed apart and then added round to the log-sum-exp of the whole row. Compiled, the FP64
    accumulator is part of the fused reduction. (FP32 sums, or FP32 partial sums over blocks of
    columns, round differently wherever a shard boundary cuts them: measured, a TP run then left one
    process's parameters by 1.2e-5 after AdamW steps, over the tests' 1e-5.)"""
    zf = _widen(z)
    target = zf.gather(1, local[:, None]).squeeze(1) * mine
    return torch.exp(zf - top[:, None]).sum(dim=1, dtype=torch.float64), target.double()


def _sum_exp_sliced(z, top, local, mine) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sum_exp` eagerly: the exponentials in place, their FP64 sum taken 256 columns at a time
    (converting the whole chunk to FP64 at once measured 13x slower: the converted slices stay in
    cache)."""
    zf = _widen(z)
    target = zf.gather(1, local[:, None]).squeeze(1) * mine
    e = (zf - top[:, None]).exp_()
    total = e.new_zeros(e.shape[0], dtype=torch.float64)
    for j in range(0, e.shape[1], 256):
        total += e[:, j : j + 256].sum(dim=1, dtype=torch.float64)
    return total, target.double()


def _grad_in_place(z, lse, local, mine, coef, dtype: torch.dtype) -> torch.Tensor:
    """``coef_t (p_t - e_y_t)`` of a chunk in ``dtype`` (``p = exp(z - lse)``; ``coef`` is 0 for ignored
    tokens): in place on ``z``, made FP32 by :func:`_to_float` (eager)."""
    p = _widen(z).sub_(lse[:, None]).exp_().mul_(coef[:, None])
    p.scatter_add_(1, local[:, None], (-coef * mine)[:, None])
    return p.to(dtype)


def _grad_pointwise(z, lse, local, mine, coef, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_grad_in_place` as one element-wise expression (the target a comparison with the column
    index rather than a scatter), so that a compiler fuses it into one pass."""
    hit = (torch.arange(z.shape[1], device=z.device)[None, :] == local[:, None]) & mine[:, None]
    zf = _widen(z)
    return (coef[:, None] * (torch.exp(zf - lse[:, None]) - hit.to(zf.dtype))).to(dtype)


def _to_float(z: torch.Tensor) -> torch.Tensor:
    return _widen(z)


def _as_is(z: torch.Tensor) -> torch.Tensor:
    return z


class Kernels(NamedTuple):
    """The element-wise work of a chunk: ``prepare(z)`` (what the others take: eager, the FP32 logits,
    made once; compiled, the compute-dtype ones, which the fused kernels read and convert on the fly),
    ``row_max(z)``, ``sum_exp(z, top, local, mine)`` and ``grad(z, lse, local, mine, coef, dtype)``."""

    prepare: object
    row_max: object
    sum_exp: object
    grad: object


EAGER = Kernels(_to_float, _row_max, _sum_exp_sliced, _grad_in_place)


@functools.cache
def compiled_kernels(**options) -> Kernels:
    """:data:`EAGER`'s kernels in the forms a compiler fuses (one pass each), through
    ``torch.compile(**options)``."""
    compiled = (torch.compile(k, **options) for k in (_row_max, _sum_exp, _grad_pointwise))
    return Kernels(_as_is, *compiled)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b``: straight into the FP32 ``out`` when ``a`` and ``b`` are FP32, else through the
    compute-dtype product (CPU matmuls have no FP32 output for BF16 inputs)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    elif accumulate:
        out += torch.mm(a, b)
    else:
        out.copy_(torch.mm(a, b))


class _Chunks:
    """What the chunks of one call share: compute-dtype copies of the hidden states and of the weight,
    and the targets in this rank's row numbering (``local``: ``y - vocab_start``, 0 where not
    ours; ``mine``: ours and not ignored)."""

    def __init__(self, hidden, weight, targets, scale, chunk, dtype, group, vocab_start, kernels):
        self.x = hidden.to(dtype)
        self.w = weight.to(dtype)
        self.scale, self.group, self.kernels = scale, group, kernels
        self.chunk = chunk or max(hidden.shape[0], 1)
        self.valid = targets != IGNORE_INDEX
        local = targets - vocab_start
        self.mine = self.valid & (local >= 0) & (local < weight.shape[0])
        self.local = torch.where(self.mine, local, 0)

    def spans(self) -> list[tuple[int, int]]:
        n = self.x.shape[0]
        return [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]

    def logits(self, a: int, b: int) -> torch.Tensor:
        """Logits of tokens ``a..b`` over this rank's vocabulary rows, in the compute dtype, times ``s``
        (then as the kernels take them: ``Kernels.prepare``)."""
        z = torch.mm(self.x[a:b], self.w.t())
        return self.kernels.prepare(z.mul_(self.scale) if self.scale != 1.0 else z)

    def stats(self, z: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lse, target logit)`` of tokens ``a..b`` over the whole vocabulary: the row maxima
        all-reduced (MAX), then the sums of exponentials and the target logits (SUM), so that a rank's
        softmax is the whole vocabulary's (and the single-process one up to the order of the sum)."""
        top = _all_reduce(self.kernels.row_max(z), dist.ReduceOp.MAX, self.group)
        sums = self.kernels.sum_exp(z, top, self.local[a:b], self.mine[a:b])
        if self.group is not None:
            sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, self.group)
        acc = wide(self.x.dtype)
        return (top + sums[0].log()).to(acc), sums[1].to(acc)

    def softmax_grad(self, z, lse, coef, a: int, b: int) -> torch.Tensor:
        """The chunk's softmax gradient ``coef_t (p_t - e_y_t)`` in the compute dtype (``coef`` carries
        the factor ``s``; ``z`` is consumed)."""
        return self.kernels.grad(z, lse, self.local[a:b], self.mine[a:b], coef[a:b], self.x.dtype)

    def accumulate(self, g, a: int, b: int, grad_x, grad_w) -> None:
        """``grad_x[a:b] = g W`` and ``grad_w += g^T x`` (matmuls in the compute dtype, sums in FP32)."""
        if grad_x is not None:
            _mm_into(grad_x[a:b], g, self.w, accumulate=False)
        if grad_w is not None:
            _mm_into(grad_w, g.t(), self.x[a:b], accumulate=True)

    def buffers(self, need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """FP32 gradient buffers of the hidden states and of this rank's weight rows, where needed."""
        acc = wide(self.x.dtype)
        grad_x = self.x.new_empty(self.x.shape, dtype=acc) if need_x else None
        grad_w = self.w.new_zeros(self.w.shape, dtype=acc) if need_w else None
        return grad_x, grad_w

    def finish(self, grad_x: torch.Tensor | None) -> None:
        """Sum the hidden-state gradient over the vocabulary shards (one all-reduce of ``N x d``)."""
        if grad_x is not None:
            _all_reduce(grad_x, dist.ReduceOp.SUM, self.group)

    # One chunk's work each: its (chunk x V) temporaries die when the method returns, before the next
    # chunk allocates its own.

    def sum_chunk(self, a: int, b: int, losses, coef, grad_x, grad_w) -> None:
        """Losses of tokens ``a..b`` and, into the buffers, their gradients for an upstream gradient of 1
        (``coef``: ``s`` at valid tokens, 0 at ignored ones)."""
        z = self.logits(a, b)
        lse, target = self.stats(z, a, b)
        losses[a:b] = (lse - target) * self.valid[a:b]
        if grad_x is not None or grad_w is not None:
            g = self.softmax_grad(z, lse, coef, a, b)
            del z  # the chunk's logits are not needed past the softmax gradient
            self.accumulate(g, a, b, grad_x, grad_w)

    def token_chunk(self, a: int, b: int, losses, lse) -> None:
        """Losses and log-sum-exp of tokens ``a..b``."""
        lse[a:b], target = self.stats(self.logits(a, b), a, b)
        losses[a:b] = (lse[a:b] - target) * self.valid[a:b]

    def token_chunk_backward(self, a: int, b: int, lse, coef, grad_x, grad_w) -> None:
        """Gradients of tokens ``a..b`` from the recomputed logits (``coef``: the upstream gradient, 0 at
        ignored tokens)."""
        self.accumulate(self.softmax_grad(self.logits(a, b), lse[a:b], coef, a, b), a, b, grad_x, grad_w)


def _cast(grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if grad is None else grad.to(dtype)


class _PrecomputedSum(torch.autograd.Function):
    """``sum_t l_t``; forward also computes both gradients for an upstream gradient of 1, which backward
    returns scaled (copies: the kept ones stay for a second backward)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk, dtype, group, vocab_start, kernels):
        c = _Chunks(hidden, weight, targets, scale, chunk, dtype, group, vocab_start, kernels)
        grad_x, grad_w = c.buffers(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        coef = c.valid.to(wide(dtype)) * scale
        losses = hidden.new_empty(targets.shape, dtype=wide(dtype))
        for a, b in c.spans():
            c.sum_chunk(a, b, losses, coef, grad_x, grad_w)
        c.finish(grad_x)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        gx = None if grad_x is None else (grad_x * grad_out).to(ctx.dtypes[0])
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[1])
        return gx, gw, *([None] * 7)


class _FusedCrossEntropy(torch.autograd.Function):
    """``l_t`` per token; backward recomputes each chunk's logits from the saved hidden states, weight
    and log-sum-exp (a sum is these values summed: its upstream gradient is the same for every token)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk, dtype, group, vocab_start, kernels):
        c = _Chunks(hidden, weight, targets, scale, chunk, dtype, group, vocab_start, kernels)
        losses = hidden.new_empty(targets.shape, dtype=wide(dtype))
        lse = torch.empty_like(losses)
        for a, b in c.spans():
            c.token_chunk(a, b, losses, lse)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.args = (scale, chunk, dtype, group, vocab_start, kernels)
        return losses

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        c = _Chunks(hidden, weight, targets, *ctx.args)
        grad_x, grad_w = c.buffers(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        coef = grad_out.to(wide(c.x.dtype)) * c.valid * c.scale
        for a, b in c.spans():
            c.token_chunk_backward(a, b, lse, coef, grad_x, grad_w)
        c.finish(grad_x)
        return _cast(grad_x, hidden.dtype), _cast(grad_w, weight.dtype), *([None] * 7)


@torch.compiler.disable
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    scale: float = 1.0,
    chunk: int = 0,
    reduction: str = "sum",
    dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    kernels: Kernels = EAGER,
) -> torch.Tensor:
    """Cross-entropy of ``scale * (hidden @ weight.T)`` against ``targets`` (formulas in the module
    docstring), ``chunk`` tokens at a time (0: all at once).

    ``hidden``: ``(N, d)``; ``weight``: ``(V, d)``, or this rank's rows ``vocab_start ..`` of the whole
    head when ``group`` (the tensor-parallel group; every rank passes the same ``hidden`` and
    ``targets``); ``targets``: ``(N,)`` int64 whole-vocabulary ids, ``-100`` ignored. ``dtype``: the
    matmuls' dtype (default: ``weight``'s; BF16 under autocast is the caller's to pass). ``reduction``:
    ``"sum"`` (FP32 scalar) or ``"none"`` (FP32 ``(N,)``, 0 at ignored targets; FP64 for FP64 matmuls). Gradients come back in
    the dtypes of ``hidden`` and ``weight``. ``kernels``: :data:`EAGER` or :func:`compiled_kernels`.

    An outer ``torch.compile`` runs it as it is (``torch.compiler.disable``: the compiled training
    objective breaks its graph around it), because traced into the graph its memory would be the
    partitioner's, not its own: AOTAutograd places what only backward needs into backward and keeps
    the smallest tensors for it, which moved the forward's gradient matmuls to backward and kept each
    chunk's softmax gradient (or, for the per-token loss, each chunk's logits), (tokens x vocab) values
    again; with the recomputing per-token backward it also gave wrong gradients on this torch (2.13,
    uneven chunks). The element-wise kernels are compiled on their own instead (``kernels``).
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden (N, d) and targets (N,) expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}"
        )
    dtype = dtype or weight.dtype
    args = (hidden, weight, targets, float(scale), chunk, dtype, group, vocab_start, kernels)
    if reduction == "none":
        return _FusedCrossEntropy.apply(*args)
    if precomputes(hidden.shape[0], weight.shape[0], hidden.shape[1], chunk, dtype.itemsize):
        return _PrecomputedSum.apply(*args)
    return _FusedCrossEntropy.apply(*args).sum()
