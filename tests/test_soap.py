"""SOAP (``lmforge/optim/soap.py``) against its formula written out in plain torch, against torch's AdamW
where it falls back to AdamW, and through a state-dict round trip."""

from __future__ import annotations

import io

import pytest
import torch

from lmforge.optim.soap import SOAP

# eps = 1e-4: a 2 x 3 gradient leaves the 3 x 3 factor of step 1 rank 2, so one rotated direction holds only
# rounding (~1e-17 in float64), which Adam divides by itself plus eps: noise of size rounding / eps in both
# computations (seen: 9.4e-10 apart with eps = 1e-8). With 1e-4 that noise is ~1e-13, while eps still moves
# the other entries by ~1e-4 relative (g' / (|g'| + eps) at step 1), far above the bound.
LR, B1, B2, BS, EPS, WD = 0.1, 0.9, 0.95, 0.8, 1e-4, 0.1


def soap_by_hand(w0: torch.Tensor, grads: list[torch.Tensor], freq: int, max_dim: int) -> torch.Tensor:
    """The module docstring's update, one line of math at a time, in float64: factors, eigh at step 1,
    a re-sorted subspace-iteration step with QR at each refresh, Adam moments in the eigenbasis."""
    m_rows, n_cols = w0.shape
    w, mom, var = w0.clone(), torch.zeros_like(w0), torch.zeros_like(w0)
    left, right = torch.zeros(m_rows, m_rows, dtype=w0.dtype), torch.zeros(n_cols, n_cols, dtype=w0.dtype)
    q_left, q_right = torch.eye(m_rows, dtype=w0.dtype), torch.eye(n_cols, dtype=w0.dtype)
    use_left, use_right = m_rows <= max_dim, n_cols <= max_dim
    for t, g in enumerate(grads, start=1):
        left = BS * left + (1 - BS) * g @ g.T
        right = BS * right + (1 - BS) * g.T @ g
        if t == 1:
            if use_left:
                q_left = torch.linalg.eigh(left).eigenvectors.flip(1)
            if use_right:
                q_right = torch.linalg.eigh(right).eigenvectors.flip(1)
        elif (t - 1) % freq == 0:
            if use_left:
                order = torch.argsort(-torch.diag(q_left.T @ left @ q_left), stable=True)
                var = var[order, :]
                q_left = torch.linalg.qr(left @ q_left[:, order]).Q
            if use_right:
                order = torch.argsort(-torch.diag(q_right.T @ right @ q_right), stable=True)
                var = var[:, order]
                q_right = torch.linalg.qr(right @ q_right[:, order]).Q
        mom = B1 * mom + (1 - B1) * g
        g_rot = q_left.T @ g @ q_right
        var = B2 * var + (1 - B2) * g_rot**2
        m_hat = (q_left.T @ mom @ q_right) / (1 - B1**t)
        v_hat = var / (1 - B2**t)
        w = w * (1 - LR * WD) - LR * q_left @ (m_hat / (v_hat.sqrt() + EPS)) @ q_right.T
    return w


def run_soap(
    w0: torch.Tensor, grads: list[torch.Tensor], freq: int, max_dim: int
) -> tuple[torch.Tensor, SOAP]:
    p = torch.nn.Parameter(w0.clone())
    opt = SOAP(
        [p],
        lr=LR,
        betas=(B1, B2),
        eps=EPS,
        weight_decay=WD,
        shampoo_beta=BS,
        precondition_frequency=freq,
        max_precond_dim=max_dim,
    )
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


W23 = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]]
G23 = [
    [[1.0, -2.0, 0.5], [0.3, 0.8, -1.2]],
    [[-0.4, 1.1, 0.9], [2.0, -0.6, 0.1]],
    [[0.7, 0.2, -1.5], [-1.0, 0.4, 0.6]],
]


@pytest.mark.parametrize("transpose", [False, True], ids=["2x3", "3x2"])
@pytest.mark.parametrize(
    ("steps", "freq", "max_dim", "scales"),
    [(2, 10, 100, (1, 1)), (2, 1, 100, (1, 1)), (3, 1, 100, (1, 3, 10)), (2, 1, 2, (1, 1))],
    ids=["eigh-then-same-basis", "eigh-then-qr-refresh", "two-qr-refreshes", "one-sided"],
)
def test_soap_matches_the_formula_by_hand(transpose, steps, freq, max_dim, scales):
    """Two (three) steps on a 2 x 3 and a 3 x 2 matrix with fixed gradients: the basis kept from step 1
    (freq 10), refreshed by QR at every later step (freq 1), and one-sided (``max_precond_dim = 2``: the
    side of 3 is not rotated). In the three-step case the gradients grow (x 3, x 10) so that the eigenvalue
    estimates change order at the first refresh (the 3 x 3 factor's columns go [1, 0, 2]): the re-sorting
    and V's permutation matter there (seen: without V's permutation the result moves by 0.93, without the
    re-sorting by 0.084)."""
    w0 = torch.tensor(W23, dtype=torch.float64)
    grads = [torch.tensor(g, dtype=torch.float64) * k for g, k in zip(G23, scales, strict=False)]
    if transpose:
        w0, grads = w0.T.contiguous(), [g.T.contiguous() for g in grads]
    got, opt = run_soap(w0, grads, freq, max_dim)
    want = soap_by_hand(w0, grads, freq, max_dim)
    # float64: the two compute the same math in other orders (lerp against b * x + (1 - b) * y, a summed
    # diagonal against torch.diag): rounding of ~1e-16 relative, and the rank-deficient direction's noise
    # (see EPS). Measured max difference 6.2e-13 (of weights ~1); 1e-11 is room, far below a one-step
    # change of any term (lr * wd * w = 5e-3 ... lr = 0.1) and eps's own effect (~1e-5).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)
    state = opt.state[opt.param_groups[0]["params"][0]]
    keys = {"step", "exp_avg", "exp_avg_sq", "L", "QL", "R", "QR"}
    if max_dim == 2:  # the side of 3 keeps no factor
        keys -= {"R", "QR"} if not transpose else {"L", "QL"}
    assert set(state) == keys and float(state["step"]) == steps


def test_soap_takes_adamw_for_vectors_and_oversized_matrices():
    """A vector, a 3-D tensor and a matrix with both sides over ``max_precond_dim``: torch's AdamW."""
    torch.manual_seed(0)
    shapes = [(5,), (2, 3, 4), (6, 7)]
    ours = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    soap = SOAP(ours, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, max_precond_dim=5)
    adamw = torch.optim.AdamW(ref, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, foreach=False)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        soap.step()
        adamw.step()
    for a, b in zip(ours, ref, strict=True):
        # the same element-wise formula; torch divides lr by the bias correction in another order: float64
        # rounding (measured <= 2.2e-16); 1e-12 is room
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert set(soap.state[ours[2]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_soap_state_dict_round_trip_continues_exactly():
    """5 steps straight against 3 steps, ``state_dict`` through ``torch.save``, a fresh SOAP loading it, and
    2 more (a refresh at step 5 with frequency 2): bitwise the same weights and state."""
    torch.manual_seed(0)
    w0 = torch.randn(6, 4)
    grads = [torch.randn(6, 4) for _ in range(5)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "precondition_frequency": 2}

    def fresh(w: torch.Tensor) -> tuple[torch.nn.Parameter, SOAP]:
        p = torch.nn.Parameter(w.clone())
        return p, SOAP([p], **kwargs)

    a, opt_a = fresh(w0)
    for g in grads:
        a.grad = g.clone()
        opt_a.step()
    b, opt_b = fresh(w0)
    for g in grads[:3]:
        b.grad = g.clone()
        opt_b.step()
    buf = io.BytesIO()
    torch.save(opt_b.state_dict(), buf)
    c, opt_c = fresh(b.detach())
    buf.seek(0)
    opt_c.load_state_dict(torch.load(buf, weights_only=True))
    for g in grads[3:]:
        c.grad = g.clone()
        opt_c.step()
    assert torch.equal(a, c)
    state_a, state_c = opt_a.state[a], opt_c.state[c]
    assert state_a.keys() == state_c.keys() == {"step", "exp_avg", "exp_avg_sq", "L", "QL", "R", "QR"}
    for key, value in state_a.items():
        assert torch.equal(value, state_c[key]), key
