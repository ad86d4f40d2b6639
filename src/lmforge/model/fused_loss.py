"""The output head and the cross-entropy fused: ``(hidden, weight, targets) -> loss``, chunk by chunk in
forward and backward, never holding the (tokens x vocabulary) logits or their gradient.

For ``N`` tokens ``x_t`` (rows of ``hidden``), a head ``W`` (``V x d``), logit scale ``s`` (muP's
``1 / width_mult``) and targets ``y_t`` (``-100``: ignored)::

    z_t   = s * (x_t W^T)                    logits, the matmul in the compute dtype, the rest in FP32
    lse_t = log sum_j exp(z_tj)              = m_t + log sum_j exp(z_tj - m_t),  m_t = max_j z_tj
    l_t   = lse_t - z_t,y_t                  (0 where y_t = -100)
    dl_t / dz_tj = p_tj - [j = y_t],         p_tj = exp(z_tj - lse_t)
    dL/dx_t = s g_t (p_t - e_y_t) W,  dL/dW = s sum_t g_t (p_t - e_y_t)^T x_t     (g_t: upstream gradient)

Two reductions: ``"sum"`` (the next-token loss: ``sum_t l_t``, FP32 scalar) and ``"none"`` (``l_t`` per
token, FP32: DPO sums them per sequence). Tokens are processed ``chunk`` at a time (``0``: all at once),
so the largest temporaries are one chunk's ``chunk x V`` logits (FP32) and their compute-dtype copy.

What is kept for backward (the point of fusing, measured in docs/memory.md):

* ``"sum"``: the gradients themselves. The upstream gradient of a sum is one scalar, so forward computes
  ``dL/dx`` (FP32, ``N x d``) and ``dL/dW`` (FP32, ``V x d``) chunk by chunk for ``g = 1`` and backward
  only scales them: three head matmuls per step, as unfused, not four.
* ``"none"``: the hidden states, the weight (both already alive), the targets and the FP32 log-sum-exp
  (``N`` values); backward recomputes each chunk's logits (one more matmul) with the per-token upstream
  gradient folded into the softmax gradient.

Vocabulary parallelism (``group``: the tensor-parallel process group): each rank holds rows
``[vocab_start, vocab_start + V_local)`` of ``W`` and every token's hidden state. Per chunk, the row
maximum is all-reduced (MAX) and then the sum of exponentials and the target logit (zero on the ranks
that do not hold the target) together (SUM): ``3 x chunk`` FP32 values per chunk, instead of gathering
``chunk x V`` logits. ``dL/dx`` is a partial sum over each rank's rows and is all-reduced once (``N x d``);
``dL/dW`` is this rank's rows, complete.

Why lmforge's own autograd Function rather than ``torch.nn.functional.linear_cross_entropy`` (torch 2.13,
with ``LinearCrossEntropyOptions``, the same forward-precomputed gradients): (1) it cannot shard the
vocabulary across ranks; (2) on CPU its chunked path runs BF16 inputs through FP32 matmuls (its
``accurate`` policy; the others fall back to it or to emulated BF16 kernels), measured 5x slower per
matmul here than the BF16 matmul and about 1.3x slower for the whole default training step (figures
in ``benchmarks/fused_loss.py``); (3) it returns the loss (and per-token losses) in the input dtype, so
a BF16 loss sum of thousands of tokens would be rounded to 8 significant bits; (4) under
``torch.compile`` it runs as an opaque op, while this one is traced into the training graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _Chunks:
    """What every chunk of one call shares: compute-dtype copies of the inputs and the targets in this
    rank's row numbering (``local``: ``y - vocab_start``, 0 where not ours; ``mine``: ours and not
    ignored)."""

    def __init__(self, hidden, weight, targets, scale, chunk, dtype, group, vocab_start):
        self.x, self.w = hidden.to(dtype), weight.to(dtype)
        self.scale, self.group = scale, group
        self.chunk = chunk or max(hidden.shape[0], 1)
        self.valid = targets != IGNORE_INDEX
        local = targets - vocab_start
        self.mine = self.valid & (local >= 0) & (local < weight.shape[0])
        self.local = torch.where(self.mine, local, 0)

    def spans(self):
        n = self.x.shape[0]
        return [(a, min(a + self.chunk, n)) for a in range(0, n, self.chunk)]

    def logits(self, a: int, b: int) -> torch.Tensor:
        """``s * x W^T`` of tokens ``a..b`` (this rank's vocabulary rows): the matmul in the compute
        dtype, the result in FP32."""
        z = torch.mm(self.x[a:b], self.w.t()).float()
        return z.mul_(self.scale) if self.scale != 1.0 else z

    def stats(self, z: torch.Tensor, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lse, sum of exponentials, target logit)`` of the chunk ``z`` over the whole vocabulary (all
        ranks); leaves ``exp(z - max)`` in ``z`` (so ``z / sum`` is the softmax)."""
        m = _all_reduce(z.amax(dim=1), dist.ReduceOp.MAX, self.group)
        target = z.gather(1, self.local[a:b, None]).squeeze(1) * self.mine[a:b]
        z.sub_(m[:, None]).exp_()
        sums = _all_reduce(torch.stack([z.sum(dim=1), target]), dist.ReduceOp.SUM, self.group)
        return m + sums[0].log(), sums[0], sums[1]

    def softmax_grad(self, e: torch.Tensor, factor: torch.Tensor, coef: torch.Tensor, a: int, b: int):
        """``coef_t * (p_t - e_y_t)`` in place in ``e`` (``e * factor`` is ``coef * p``; ``coef`` is 0 for
        ignored tokens), returned in the compute dtype for the two gradient matmuls."""
        e.mul_(factor[:, None])
        e.scatter_add_(1, self.local[a:b, None], (-coef * self.mine[a:b])[:, None])
        return e.to(self.x.dtype)

    def accumulate(self, g: torch.Tensor, a: int, b: int, grad_x, grad_w) -> None:
        """``grad_x[a:b] = g W`` and ``grad_w += g^T x`` (matmuls in the compute dtype, sums in FP32)."""
        if grad_x is not None:
            grad_x[a:b] = torch.mm(g, self.w)
        if grad_w is not None:
            grad_w += torch.mm(g.t(), self.x[a:b])

    def buffers(self, need_x: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """FP32 gradient buffers of the hidden states and of this rank's weight rows, where needed."""
        grad_x = self.x.new_empty(self.x.shape, dtype=torch.float32) if need_x else None
        grad_w = self.w.new_zeros(self.w.shape, dtype=torch.float32) if need_w else None
        return grad_x, grad_w

    def finish(self, grad_x: torch.Tensor | None) -> None:
        """Sum the hidden-state gradient over the vocabulary shards (one all-reduce of ``N x d``)."""
        if grad_x is not None:
            _all_reduce(grad_x, dist.ReduceOp.SUM, self.group)


def _cast(grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if grad is None else grad.to(dtype)


class _SumLoss(torch.autograd.Function):
    """``sum_t l_t``; forward also computes both gradients for an upstream gradient of 1, which backward
    scales (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk, dtype, group, vocab_start):
        c = _Chunks(hidden, weight, targets, scale, chunk, dtype, group, vocab_start)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x, grad_w = c.buffers(need_x, need_w)
        coef = c.valid.float() * scale
        losses = hidden.new_empty(targets.shape, dtype=torch.float32)
        for a, b in c.spans():
            z = c.logits(a, b)
            lse, sumexp, target = c.stats(z, a, b)
            losses[a:b] = (lse - target) * c.valid[a:b]
            if need_x or need_w:
                g = c.softmax_grad(z, coef[a:b] / sumexp, coef[a:b], a, b)
                c.accumulate(g, a, b, grad_x, grad_w)
        c.finish(grad_x)
        ctx.save_for_backward(grad_x, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        gx = _cast(grad_x * grad_out if grad_x is not None else None, ctx.dtypes[0])
        gw = _cast(grad_w * grad_out if grad_w is not None else None, ctx.dtypes[1])
        return gx, gw, None, None, None, None, None, None


class _TokenLoss(torch.autograd.Function):
    """``l_t`` per token; backward recomputes each chunk's logits from the saved hidden states, weight
    and log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk, dtype, group, vocab_start):
        c = _Chunks(hidden, weight, targets, scale, chunk, dtype, group, vocab_start)
        losses = hidden.new_empty(targets.shape, dtype=torch.float32)
        lse = torch.empty_like(losses)
        for a, b in c.spans():
            lse[a:b], _, target = c.stats(c.logits(a, b), a, b)
            losses[a:b] = (lse[a:b] - target) * c.valid[a:b]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.args = (scale, chunk, dtype, group, vocab_start)
        return losses

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse = ctx.saved_tensors
        c = _Chunks(hidden, weight, targets, *ctx.args)
        grad_x, grad_w = c.buffers(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        coef = grad_out.float() * c.valid * c.scale
        for a, b in c.spans():
            p = c.logits(a, b).sub_(lse[a:b, None]).exp_()
            c.accumulate(c.softmax_grad(p, coef[a:b], coef[a:b], a, b), a, b, grad_x, grad_w)
        c.finish(grad_x)
        return _cast(grad_x, hidden.dtype), _cast(grad_w, weight.dtype), None, None, None, None, None, None


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
) -> torch.Tensor:
    """Cross-entropy of ``scale * hidden @ weight.T`` against ``targets`` (formulas in the module
    docstring), ``chunk`` tokens at a time (0: all at once).

    ``hidden``: ``(N, d)``; ``weight``: ``(V, d)``, or this rank's rows ``vocab_start ..`` of the whole
    head when ``group`` (the tensor-parallel group; every rank passes the same ``hidden`` and
    ``targets``); ``targets``: ``(N,)`` int64 whole-vocabulary ids, ``-100`` ignored. ``dtype``: the
    matmuls' dtype (default: ``weight``'s; BF16 under autocast is the caller's to pass). ``reduction``:
    ``"sum"`` (FP32 scalar) or ``"none"`` (FP32 ``(N,)``, 0 at ignored targets). Gradients come back in
    the dtypes of ``hidden`` and ``weight``.
    """
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden (N, d) and targets (N,) expected, got {tuple(hidden.shape)}, {tuple(targets.shape)}"
        )
    fn = _SumLoss if reduction == "sum" else _TokenLoss
    return fn.apply(hidden, weight, targets, float(scale), chunk, dtype or weight.dtype, group, vocab_start)
