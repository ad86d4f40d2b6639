"""The fused output head + cross-entropy (lmforge/model/fused_loss.py through model/head.py and
model/loss.py::head_loss): values and gradients against ``F.cross_entropy`` on the full FP32 logits, and
the memory it keeps, measured with storage trackers against the unfused loss and the former chunked one.

The vocabulary-parallel version (tensor parallelism) and the FSDP2 gather of an untied head run in real
processes: ``tests/distributed/fused_loss_worker.py`` under torchrun.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from lmforge.config import ModelConfig
from lmforge.model.fused_loss import linear_cross_entropy, precomputes
from lmforge.model.loss import NextTokenLoss, head_loss
from lmforge.posttrain.dpo import SequenceLogps
from lmforge.probes.activation_memory import saved_activation_bytes
from tests.conftest import model_of
from tests.torchrun import torchrun, worker

V, D = 96, 32
# FP32 bounds below come from rounding, not from one machine: FP32's unit roundoff is u = 2^-24 = 6e-8, and
# two sums of n terms taken in other orders differ by at most about 2 n u of the sum of magnitudes. The sums
# here are short (96-term softmax denominators, 32-term dot products, <= 50 token losses), so n u is
# ~1e-5 at worst and ~1e-6 for a random-walk sum. Each bound also names what was measured on a 2-core AMD
# EPYC with AVX-512-BF16 (no AMX) with ATen's default kernels and with AVX2 forced.


def _model(mup: bool):
    cfg = ModelConfig(n_layers=1, d_model=D, n_heads=4, mup=mup, mup_base_width=16, tie_embeddings=False)
    return model_of(cfg, V, 16)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (5 x 10 tokens, unit variance as after the final norm) and targets: every fourth
    ignored, and the whole third row."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(5, 10, D, generator=g)
    targets = torch.randint(0, V, (5, 10), generator=g)
    targets.view(-1)[::4] = -100
    targets[2] = -100
    return hidden, targets


def _loss_and_grads(fn, model, hidden, targets, upstream):
    model.zero_grad(set_to_none=True)
    h = hidden.clone().requires_grad_()
    loss = fn(model, h, targets)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, model.lm_head.weight.grad


def _reference(reduction: str):
    def fn(model, h, targets):
        logits = model.logits(h).float()  # the whole FP32 logits, muP's multiplier applied
        out = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
        return out if reduction == "sum" else out.view(targets.shape)

    return fn


@pytest.mark.parametrize("mup", [False, True], ids=["standard", "mup"])
@pytest.mark.parametrize("chunk", [0, 7, 16, 64])  # all at once, not dividing 50 tokens, more than them
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_matches_cross_entropy_on_full_fp32_logits(reduction: str, chunk: int, mup: bool):
    torch.manual_seed(0)
    model = _model(mup)
    assert model.logit_scale == (0.5 if mup else 1.0)  # width 32 over base 16
    hidden, targets = _batch()
    upstream = torch.randn(targets.shape) if reduction == "none" else torch.tensor(0.37)

    def fused(model, h, targets):
        return head_loss(model, h, targets, chunk, reduction)

    got = _loss_and_grads(fused, model, hidden, targets, upstream)
    want = _loss_and_grads(_reference(reduction), model, hidden, targets, upstream)
    assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape
    # measured: at most 23% of this bound (the loss sum of 137 1.5e-5 apart); the worst case n u over the
    # 96-term softmax and the 50-term sum is 5x the bound, a random-walk sum of them within it
    for name, g, w in zip(("loss", "hidden grad", "weight grad"), got, want, strict=True):
        # bound: see the comment above the loop
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    if reduction == "none":
        assert torch.equal(got[0][2], torch.zeros(10))  # ignored targets: no loss, no gradient
        assert torch.equal(got[1][2], torch.zeros(10, D))


@pytest.mark.parametrize("chunk", [0, 7])
@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_float64_stays_float64(reduction: str, chunk: int):
    """Float64 matmuls (the verification runs of ``train.precision = "fp64"``) keep the softmax, the losses
    and the gradient sums in float64: equal to ``F.cross_entropy`` on the whole float64 logits within
    1e-12 (float64's unit roundoff 1.1e-16 times sums of <= 96 terms and a few operations per term:
    ~1e-14; measured 3.3e-16 on a 2-core AMD EPYC with AVX-512-BF16 (no AMX)). The loss before it kept these
    in FP32 and measured 1.8e-7 here."""
    torch.manual_seed(0)
    model = _model(True).double()
    hidden, targets = _batch()
    hidden = hidden.double()
    upstream = torch.randn(targets.shape, dtype=torch.float64) if reduction == "none" else torch.tensor(0.37)

    def reference(model, h, targets):
        logits = model.logits(h)  # float64 throughout
        out = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
        return out if reduction == "sum" else out.view(targets.shape)

    got = _loss_and_grads(
        lambda m, h, y: head_loss(m, h, y, chunk, reduction), model, hidden, targets, upstream
    )
    want = _loss_and_grads(reference, model, hidden, targets, upstream)
    assert all(t.dtype == torch.float64 for t in got), [t.dtype for t in got]
    for name, g, w in zip(("loss", "hidden grad", "weight grad"), got, want, strict=True):
        # bound: see the docstring (float64: ~1e-14 worst case, 1e-12 is room)
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_all_ignored_gives_zero_loss_and_gradients():
    torch.manual_seed(0)
    model = _model(False)
    hidden, targets = _batch()
    loss, h_grad, w_grad = _loss_and_grads(
        lambda m, h, y: head_loss(m, h, y, 8), model, hidden, torch.full_like(targets, -100), 1.0
    )
    assert loss.item() == 0.0 and not h_grad.any() and not w_grad.any()


def test_next_token_loss_and_sequence_logps_are_the_fused_loss():
    """``NextTokenLoss`` is the fused sum on the model's hidden states; ``SequenceLogps`` the per-token
    values summed per row, negated: equal to the whole FP32 log-softmax's."""
    torch.manual_seed(0)
    model = _model(True)
    x, y = torch.randint(0, V, (3, 16)), torch.randint(0, V, (3, 16))
    y[:, :4] = -100
    total, n = NextTokenLoss(model, 5)(x, y)
    with torch.no_grad():
        logp = torch.log_softmax(model.logits(model(x)).double(), dim=-1)
    picked = logp.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1) * (y != -100)
    assert n.item() == 36
    # FP32 sums of 36 token losses and 96-term softmaxes against float64: measured 3.5e-8 and 7.7e-8 relative
    # (3% and 8% of the bound); 36 u = 2.2e-6 is the worst case of the token sum alone
    torch.testing.assert_close(total.double(), -picked.sum(), rtol=1e-6, atol=0)
    torch.testing.assert_close(SequenceLogps(model, 5)(x, y).double(), picked.sum(1), rtol=1e-6, atol=0)


def test_bf16_autocast_numerics_are_the_former_chunked_loss():
    """Under BF16 autocast the logits come from BF16 matmuls and the softmax is FP32, as the former
    chunked loss computed them (``F.cross_entropy(head(h).float())`` per chunk): the same loss up to FP32
    summation order, and gradients within BF16 rounding of their largest element (the former loss summed
    the chunks' weight gradients in BF16, the fused one sums them in FP32)."""
    torch.manual_seed(0)
    model = _model(True)
    hidden, targets = _batch()

    def former(model, h, targets):
        total = h.new_zeros((), dtype=torch.float32)
        for hc, yc in zip(h.flatten(0, 1).split(16), targets.flatten().split(16), strict=True):
            total = total + F.cross_entropy(model.logits(hc).float(), yc, ignore_index=-100, reduction="sum")
        return total

    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss_and_grads(lambda m, h, y: head_loss(m, h, y, 16), model, hidden, targets, 1.0)
        want = _loss_and_grads(former, model, hidden, targets, 1.0)
    assert got[0].dtype == torch.float32
    # rtol 1e-6 = ~17 u of FP32 (u = 6e-8) for the same 50-token loss summed in another order (measured: below)
    torch.testing.assert_close(
        got[0], want[0], rtol=1e-6, atol=0
    )  # FP32 sums in another order: 1.1e-7 measured
    # BF16 has 8 significant bits: one rounding moves a value by at most half an ulp, and an ulp is at most
    # 2^-7 of the value. The former loss rounds each of the 4 chunks' weight gradients to BF16 and adds them
    # in BF16 (3 more roundings): 7 half-ulps, 3.5 x 2^-7 of the largest partial sum; the fused loss sums in
    # FP32. Measured 0.92 x 2^-7 of the largest element (1.2 ulps); the bound is the derivation's, rounded up
    # to 4 x 2^-7. A gradient missing a chunk is off by a quarter of it.
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.dtype == w.dtype == torch.float32
        # bound: see the comment above the loop (4 x 2^-7 of the largest element)
        torch.testing.assert_close(g, w, rtol=0, atol=4 * 2**-7 * w.abs().max().item())


@pytest.mark.parametrize("objective", [SequenceLogps, pytest.param(NextTokenLoss, marks=pytest.mark.slow)])
def test_compiled_objective_matches_eager(objective):
    """A compiling run: the objective through ``torch.compile`` (the fused loss runs outside its graph)
    with the loss's kernels compiled (``OutputHead.compile_loss``) gives the eager loss and gradients
    (FP32; 50 tokens in chunks of 16, the last one short)."""
    torch.manual_seed(0)
    model = _model(True)
    x, y = torch.randint(0, V, (5, 10)), torch.randint(0, V, (5, 10))
    y[:, :3] = -100

    def run(fn):
        out = fn(x, y)
        (out[0] if isinstance(out, tuple) else out.sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return (out[0] if isinstance(out, tuple) else out).detach(), grads

    want = run(objective(model, 16))
    model.lm_head.compile_loss()
    got = run(torch.compile(objective(model, 16)))
    # compiled kernels sum in their own order: measured 9% of the loss bound and 6% of the gradients' (loss
    # 3.8e-6 apart on 32; gradients 2.4e-7 on 2.1), within the n u worst case of these short FP32 sums
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        # gradients: the bound in the comment above (measured 6% of it)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# -- memory -------------------------------------------------------------------------------------------------

N_MEM, V_MEM, D_MEM, CHUNK_MEM = 512, 2048, 64, 32


def _memory_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N_MEM, D_MEM, generator=g).requires_grad_()
    weight = (torch.randn(V_MEM, D_MEM, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, V_MEM, (N_MEM,), generator=g)
    return hidden, weight, targets


def _unfused(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")


def _former_chunked(h, w, y):
    total = h.new_zeros(())
    for hc, yc in zip(h.split(CHUNK_MEM), y.split(CHUNK_MEM), strict=True):
        total = total + F.cross_entropy(F.linear(hc, w).float(), yc, reduction="sum")
    return total


def _fused(reduction, chunk=CHUNK_MEM):
    return lambda h, w, y: linear_cross_entropy(h, w, y, chunk=chunk, reduction=reduction)


def _saved(fn) -> int:
    hidden, weight, targets = _memory_case()
    return saved_activation_bytes(lambda: fn(hidden, weight, targets))


def _peak(fn) -> int:
    """Peak bytes of tensors alive during forward + backward, beyond the inputs and the weight."""
    hidden, weight, targets = _memory_case()
    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        fn(hidden, weight, targets).sum().backward()
    total = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return total - 4 * (hidden.numel() + weight.numel())


def test_saved_for_backward_holds_no_tokens_by_vocab_tensor():
    """Counted storages (lmforge.probes.activation_memory): the unfused and the former chunked loss keep
    the FP32 log-softmax of every token (N x V x 4 bytes, chunking or not). The fused loss keeps, where
    it recomputes (per token; a sum with chunks of 32), one FP32 log-sum-exp per token beyond its inputs
    (the hidden states and the weight, made before it); where a sum precomputes (chunks of 128: its two
    gradients, 655,360 B, are no larger than a chunk's 1,048,576 B of temporaries), the FP32 gradients of
    the hidden states and of the weight."""
    nv = N_MEM * V_MEM * 4
    assert _saved(_unfused) >= nv
    assert _saved(_former_chunked) >= nv
    assert not precomputes(N_MEM, V_MEM, D_MEM, CHUNK_MEM, 4) and precomputes(N_MEM, V_MEM, D_MEM, 128, 4)
    assert _saved(_fused("sum")) == _saved(_fused("none")) == _saved(_fused("none", 128)) == 4 * N_MEM
    assert _saved(_fused("sum", 128)) == 4 * (N_MEM * D_MEM + V_MEM * D_MEM)


@pytest.mark.parametrize("chunk", [CHUNK_MEM, 128], ids=["recompute", "precompute"])
def test_peak_is_a_chunk_not_the_whole_logits(chunk: int):
    """torch's MemTracker over forward + backward: the fused loss's peak stays below one N x V tensor in
    FP32 (it holds a few chunk-sized FP32 temporaries and the gradients of the hidden states and of the
    weight), while the unfused and the former chunked loss hold one or more whole ones (logits,
    log-softmax, its gradient)."""
    nv = N_MEM * V_MEM * 4
    assert _peak(_unfused) >= 2 * nv and _peak(_former_chunked) >= nv
    for reduction in ("sum", "none"):
        assert _peak(_fused(reduction, chunk)) < nv


@pytest.mark.parametrize("chunk", [CHUNK_MEM, 128], ids=["recompute", "precompute"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_planner_temporaries_match_the_measured_peak(autocast: bool, chunk: int):
    """The planner's model of the summed loss (``plan/memory.py::loss_temporary`` beyond what it keeps,
    plus what it keeps: ``plan/activations.py``) against torch's MemTracker peak over forward + backward:
    within 5% (what the planner leaves out is N-sized: targets, masks, the losses)."""
    from lmforge.plan.memory import loss_temporary

    c = 2 if autocast else 4
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def fused(h, w, y):
        with context:
            return linear_cross_entropy(h, w, y, chunk=chunk, dtype=torch.bfloat16 if autocast else None)

    kept = 4 * (N_MEM + V_MEM) * D_MEM if precomputes(N_MEM, V_MEM, D_MEM, chunk, c) else 4 * N_MEM
    planned = loss_temporary("fused", chunk, V_MEM, 1, c, N_MEM, D_MEM) + kept
    measured = _peak(fused)
    # tensor bytes, not rounding: the same on every CPU. Measured -0.4% to -0.8% (7 to 12 KB: the N-sized
    # tensors the planner leaves out); 5% is the planner's stated accuracy (docs/memory-accuracy.md)
    assert abs(planned / measured - 1) < 0.05, (planned, measured)


# -- vocabulary-parallel: real processes ---------------------------------------------------------------------


def run_worker(cases: list[str]) -> str:
    proc = torchrun(2, [worker("fused_loss_worker.py"), *cases], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("USED")))  # shown with -s
    return proc.stdout


def test_tensor_parallel_loss_equals_replicated_and_gathers_no_logits():
    out = run_worker(["tp"])
    assert "OK tp" in out, out


@pytest.mark.distributed
def test_tensor_parallel_models_and_fsdp_gather_of_the_head():
    out = run_worker(["model", "fsdp"])
    assert "OK model" in out and "OK fsdp" in out, out
