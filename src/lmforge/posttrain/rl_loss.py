"""RL from rewards: the formulas, pure (advantages, the k3 KL estimator, the policy losses).

Notation for one step's rollouts: ``n`` prompts (groups), ``G = rl.group_size`` completions each, so
``N = n G`` sequences, sequence ``i`` of group ``g`` with reward ``r_gi``, its completion tokens ``t``
(``m_it = 1`` on them, ``|o_i| = sum_t m_it``), the policy's log-probability ``log p_it`` of each, the
sampling policy's ``log q_it`` ("old") and the frozen reference's ``log p_ref_it``.

Advantages (:func:`group_advantages`, one value per sequence, shared by its tokens):

* GRPO (Shao et al. 2024, DeepSeekMath, outcome supervision): ``A_gi = (r_gi - mean_g) / (std_g + eps)``,
  ``std_g`` the unbiased (``G - 1``) standard deviation of the group's rewards (as TRL), ``eps = 1e-4``;
* Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): ``A_gi = r_gi - mean_g`` (no std:
  dividing by it weights easy and hopeless prompts up);
* RLOO (Ahmadian et al. 2024, after Kool et al. 2019): ``A_gi = r_gi - (sum_j r_gj - r_gi) / (G - 1)``, the
  mean of the *other* completions as baseline (unbiased), which equals ``G / (G - 1) (r_gi - mean_g)``.

KL to the reference (:func:`k3`, Schulman 2020, "Approximating KL divergence"): per token,
``k3 = exp(d) - d - 1`` with ``d = log p_ref - log p``. It is never negative, is 0 exactly where the policy
equals the reference, and its expectation under the policy is ``KL(p || p_ref)`` (unbiased: ``E_p[exp(d)]
= 1``); its gradient is taken through ``log p`` (the reference is frozen).

Policy losses (:func:`policy_loss`): with the importance ratio ``rho_it = exp(log p_it - log q_it)`` and
``eps_c = rl.clip_epsilon``, the clipped surrogate of PPO (Schulman et al. 2017) per token

    l_it = -min(rho_it A_i, clip(rho_it, 1 - eps_c, 1 + eps_c) A_i) + beta k3_it

and a group's loss aggregates them (``rl.loss``):

* ``grpo``:    ``L_g = 1/G sum_i 1/|o_i| sum_t m_it l_it`` (each sequence's token mean, then the mean);
* ``dr_grpo``: ``L_g = 1/(G T) sum_i sum_t m_it l_it``, ``T = rl.max_new_tokens`` a constant (no length
  normalisation: long wrong answers are not penalised less per token);
* ``dapo``:    ``L_g = sum_i sum_t m_it l_it / sum_i |o_i|`` (Yu et al. 2025: a token-level mean over the
  group, every token weighing the same);
* RLOO (``rl.algorithm = "rloo"``) works on whole sequences: ``rho_i = exp(sum_t m_it (log p_it - log
  q_it))`` and ``L_g = 1/G sum_i [-min(rho_i A_i, clip(rho_i, 1 - eps_c, 1 + eps_c) A_i) + beta sum_t m_it
  k3_it]``; at ``rho_i = 1`` its gradient is REINFORCE's ``-A_i grad log p(o_i)``.

The step's loss is ``sum_g L_g / n`` (the mean over the step's groups, every micro-batch and rank).
At a rollout's first update ``log q`` is the policy's own (``posttrain/rl.py``: rollout cycles): the ratio
is exactly 1 and the clip does not bind, but ``grad rho = rho grad log p = grad log p`` is not zero: the
gradient is the policy gradient ``-A grad log p`` (plus the KL term's). From its second update on
(``rl.ppo_epochs`` or ``rl.mini_batches`` above 1) the policy has moved and the clip binds where
``rho A`` leaves the trust region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-4  # GRPO's std guard (TRL's)
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
LOSSES = ("grpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """Advantages of ``rewards`` (``(n, G)``: a row per prompt) by ``kind`` (``grpo``, ``dr_grpo``,
    ``rloo``; the module docstring's formulas), same shape, float32."""
    r = rewards.float()
    g = r.shape[1]
    if g < 2:
        raise ValueError("advantages need at least 2 completions per prompt")
    mean = r.mean(dim=1, keepdim=True)
    if kind == "grpo":
        return (r - mean) / (r.std(dim=1, keepdim=True) + EPS)
    if kind == "dr_grpo":
        return r - mean
    if kind == "rloo":
        return r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    raise ValueError(f"unknown advantage {kind!r}; one of {ADVANTAGES}")


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of ``KL(p || p_ref)`` per token: ``exp(d) - d - 1``, ``d = ref_logp - logp``."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class LossParts:
    """A batch's per-group losses (with gradient) and its token figures (no gradient): the masked sums of
    k3 and of the clipped indicator (tokens; RLOO: sequences whose clipped term was taken), and the tokens."""

    groups: torch.Tensor  # (n,)
    kl_sum: torch.Tensor
    clipped: torch.Tensor
    clip_count: torch.Tensor  # what clipped counts over: tokens, or sequences (RLOO)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``-min(ratio A, clip(ratio) A)`` and where the clipped term is the one taken (bool)."""
    plain = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps) * adv
    taken = clipped < plain
    return -torch.minimum(plain, clipped), taken.detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    group_size: int,
    variant: str,
    clip_epsilon: float,
    beta: float,
    max_new_tokens: int,
) -> LossParts:
    """Per-group losses (module docstring) of ``N = n G`` sequences, groups consecutive.

    ``logp``, ``old_logp``, ``ref_logp`` (None with ``beta = 0``), ``mask``: ``(N, T)`` per completion
    token (``mask`` 1 on the completion's tokens); ``advantages``: ``(N,)``; ``variant``: ``grpo``,
    ``dr_grpo``, ``dapo`` (token losses aggregated) or ``rloo`` (sequence ratio)."""
    m = mask.to(logp.dtype)
    n = logp.shape[0] // group_size
    kl = k3(logp, ref_logp) * m if ref_logp is not None and beta else torch.zeros_like(logp)
    if variant == "rloo":
        ratio = torch.exp(((logp - old_logp) * m).sum(dim=1))
        surrogate, taken = _clipped(ratio, advantages, clip_epsilon)
        per_seq = surrogate + beta * kl.sum(dim=1)
        groups = per_seq.view(n, group_size).mean(dim=1)
        return LossParts(groups, kl.detach().sum(), taken.sum().float(), torch.tensor(float(len(ratio))))
    ratio = torch.exp(logp - old_logp)
    surrogate, taken = _clipped(ratio, advantages[:, None], clip_epsilon)
    tokens = (surrogate + beta * kl) * m
    if variant == "grpo":
        per_seq = tokens.sum(dim=1) / m.sum(dim=1).clamp(min=1)
        groups = per_seq.view(n, group_size).mean(dim=1)
    elif variant == "dr_grpo":
        groups = tokens.sum(dim=1).view(n, group_size).sum(dim=1) / (group_size * max_new_tokens)
    elif variant == "dapo":
        groups = tokens.sum(dim=1).view(n, group_size).sum(dim=1) / (
            m.sum(dim=1).view(n, group_size).sum(dim=1).clamp(min=1)
        )
    else:
        raise ValueError(f"unknown loss {variant!r}; one of {LOSSES} or rloo")
    return LossParts(groups, kl.detach().sum(), (taken & (m > 0)).sum().float(), m.sum().detach())
