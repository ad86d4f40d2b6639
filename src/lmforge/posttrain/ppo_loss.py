"""PPO's formulas, pure: per-token rewards, generalised advantage estimation, whitening, the clipped
policy and value losses, explained variance.

Notation: ``N`` sampled completions, right-padded to ``T`` positions; ``m_t = 1`` on a completion's tokens
(``t = 0 .. |o| - 1``, contiguous), 0 elsewhere; ``log p_t`` the policy's log-probability of token ``t``,
``log q_t`` the sampling policy's ("old"), ``log p_ref_t`` the frozen reference's; ``V_t`` the value head's
estimate of the return from the state before token ``t`` (``posttrain/ppo.py``), ``V^old_t`` at sampling.

**Per-token rewards** (:func:`token_rewards`, as in RLHF's PPO: Ziegler et al. 2019, Stiennon et al. 2020,
Ouyang et al. 2022): the sequence's reward ``r`` is paid on its last token, and every token pays a KL
penalty to the reference with the single-sample estimator ``k1 = log q_t - log p_ref_t``::

    r_t = -beta (log q_t - log p_ref_t) + [t = |o| - 1] r

(summed over the completion, the penalty is ``-beta log q(o) / p_ref(o)``, whose expectation under the
sampling policy is ``-beta KL(q || p_ref)``).

**GAE** (:func:`gae`, Schulman et al. 2016, "High-dimensional continuous control using generalized
advantage estimation"), with ``gamma`` the discount and ``lambda`` the trace decay, the value after the
last token 0 (the episode ends)::

    delta_t = r_t + gamma V_{t+1} - V_t
    A_t     = delta_t + gamma lambda A_{t+1}        (A_{|o|} = 0)
          = sum_{l >= 0} (gamma lambda)^l delta_{t+l}
    R_t     = A_t + V_t                              (the value target)

``lambda = 1`` gives the Monte-Carlo return minus the value, ``lambda = 0`` the one-step TD error.

**Whitening** (:func:`whiten`): ``A <- (A - mean(A)) / sqrt(var(A) + 1e-8)``, mean and (population)
variance over the completion tokens of the batch.

**Losses** (:func:`ppo_loss`, Schulman et al. 2017), with ``rho_t = exp(log p_t - log q_t)``,
``eps = rl.clip_epsilon``, ``eps_v = rl.value_clip``, ``c_v = rl.value_coef``::

    l^pi_t = -min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t)
    V^c_t  = V^old_t + clip(V_t - V^old_t, -eps_v, eps_v)
    l^V_t  = 1/2 max((V_t - R_t)^2, (V^c_t - R_t)^2)
    l_t    = l^pi_t + c_v l^V_t

A sequence's loss is its token mean ``1/|o| sum_t m_t l_t``, a group's (``G`` completions of one prompt)
the mean of its sequences', and the step's loss the mean over the step's groups (as GRPO's ``grpo``
aggregation in ``rl_loss.py``). The KL to the reference is in the rewards, not in the loss.

**Explained variance** (:func:`explained_variance`): ``1 - Var(R - V^old) / Var(R)`` over the completion
tokens: 1 when the values predict the returns, 0 when they do no better than a constant, negative when
worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WHITEN_EPS = 1e-8


def token_rewards(
    scores: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """``(N, T)`` per-token rewards (module docstring): ``-beta (old_logp - ref_logp)`` on each completion
    token (nothing with ``ref_logp`` None or ``beta = 0``) plus ``scores`` (``(N,)``) on each completion's
    last token; 0 off the mask. A row with no completion token gets nothing."""
    m = mask.to(old_logp.dtype)
    out = torch.zeros_like(old_logp)
    if ref_logp is not None and beta:
        out = -beta * (old_logp - ref_logp) * m
    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m > 0, positions, -1).amax(dim=1)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += scores.to(out.dtype)[rows]
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, both ``(N, T)`` and 0 off the mask, of per-token ``rewards`` and
    ``values`` (module docstring; ``lam`` is GAE's lambda). The recursion runs backwards over positions;
    a position off the mask contributes neither a value nor an advantage to the one before it."""
    m = mask.to(values.dtype)
    v = values * m
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - v[:, t]
        a = (delta + gamma * lam * next_adv) * m[:, t]
        adv[:, t] = a
        next_value, next_adv = v[:, t], a
    return adv, (adv + v) * m


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with the mean and population variance over ``mask``; 0 off it."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def explained_variance_sums(
    returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The five masked sums :func:`explained_variance` needs, so they can be added over micro-batches and
    ranks: ``[n, sum R, sum R^2, sum (R - V), sum (R - V)^2]`` (float64)."""
    m = mask.to(torch.float64)
    r, e = returns.double() * m, (returns.double() - old_values.double()) * m
    return torch.stack([m.sum(), r.sum(), (r * r).sum(), e.sum(), (e * e).sum()])


def explained_variance(sums: torch.Tensor | list[float]) -> float:
    """``1 - Var(R - V) / Var(R)`` from :func:`explained_variance_sums` (0 when the returns do not vary)."""
    n, r, r2, e, e2 = (float(s) for s in sums)
    if n < 1:
        return 0.0
    var_r = r2 / n - (r / n) ** 2
    var_e = e2 / n - (e / n) ** 2
    return 1.0 - var_e / var_r if var_r > 1e-12 else 0.0


@dataclass
class PPOParts:
    """A batch's per-group losses (with gradient) and, without gradient, the masked sums of the value
    loss ``l^V`` and of the clipped indicator, and the completion tokens."""

    groups: torch.Tensor  # (n,)
    value_loss_sum: torch.Tensor
    clipped: torch.Tensor
    tokens: torch.Tensor


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    clip_epsilon: float,
    value_clip: float,
    value_coef: float,
) -> PPOParts:
    """Per-group PPO losses (module docstring) of ``N = n G`` sequences, groups consecutive; every
    argument but the sizes and coefficients ``(N, T)``, ``advantages`` per token (already whitened)."""
    m = mask.to(logp.dtype)
    n = logp.shape[0] // group_size
    ratio = torch.exp(logp - old_logp)
    plain = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_epsilon, 1 + clip_epsilon) * advantages
    policy = -torch.minimum(plain, clipped)
    taken = (clipped < plain) & (m > 0)
    v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    value = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    tokens = (policy + value_coef * value) * m
    per_seq = tokens.sum(dim=1) / m.sum(dim=1).clamp(min=1)
    groups = per_seq.view(n, group_size).mean(dim=1)
    return PPOParts(groups, (value * m).detach().sum(), taken.sum().float(), m.sum().detach())
