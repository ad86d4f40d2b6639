"""PPO (``rl.algorithm = "ppo"``): the policy with a value head, and the objective a training step runs
through ``posttrain/objective_rl.py::RLModule`` (the formulas: ``posttrain/ppo_loss.py``).

**The value head** (:class:`PolicyValueModel`): a scalar ``value_head = Linear(d_model, 1)`` on the
policy's own last hidden state (after the final norm), ``V_t = value_head(h_t)`` at the position whose
next token is completion token ``t``. Why a head on the shared network rather than a separate value model
initialised from the policy: one forward gives both the log-probabilities and the values, so a step costs
what GRPO's costs, with no second network's weights, gradients and optimizer state (lmforge's RL runs on
small machines), and the value head is one more parameter of the model, so the optimizer, the
checkpoints (resume) and data parallelism cover it with no extra machinery. The cost: the value loss's
gradient shapes the shared network too; ``rl.value_coef`` weighs it against the policy loss. The head is
initialised as any linear layer of the model (weight ~ N(0, init_std^2), bias 0): its values start near 0.
The head is no part of the language model: ``lmforge export`` drops it (:func:`language_model_state`).

**A step** (:class:`PPOObjective`), per micro-batch of ``k`` prompts:

1. sample ``G = rl.group_size`` completions per prompt and score them, as GRPO (``posttrain/rl.py``);
2. one forward of the policy gives ``log p``, the entropy and ``V`` on the completion tokens; the frozen
   reference's ``log p_ref`` (``rl.beta > 0``); at the rollout's first update they are also the old ones;
3. (when drawn) per-token rewards (sequence reward on the last token, ``-beta (log q - log p_ref)`` on every token),
   GAE advantages and returns from the detached values (``rl.gae_gamma``, ``rl.gae_lambda``), whitened
   over the micro-batch's completion tokens (``rl.whiten_advantages``);
4. the clipped policy loss plus ``rl.value_coef`` times the clipped value loss, backward.

**Layouts** (one process, DDP, ZeRO-1, FSDP2, hybrid sharding and tensor parallelism, as GRPO): the
value head is one more parameter of the model, so DDP's reducer averages its gradient, FSDP2 shards it
with the root's parameters and tensor parallelism replicates it (:meth:`PolicyValueModel.values`);
under FSDP2 and tensor parallelism the whole copy completions are sampled from
(``parallel/whole_copy.py``) is a :class:`PolicyValueModel` too and holds the head, which sampling does
not use. **Whitening and GAE are
per micro-batch**: their statistics are those of one micro-batch's completion tokens, on the rank that
drew them, with no collective. Each data-parallel rank's micro-batches are exactly micro-batches one
process takes in turn (``rl_data.py::PromptLoader``), so a run over ``dp`` ranks computes the advantages
one process computes over the same global batch, and the update is the same (``tests/test_rl_distributed.py``:
equal in float64). Statistics over the whole step (every micro-batch of every rank) would need all of a
step's rollouts and values before its first backward: every micro-batch's graph held, or a second
forward. The price of per micro-batch: ``train.micro_batch_size`` (prompts) times ``rl.group_size``
completions set the rows whitened over, so the micro-batch size is part of the update, as the batch is
for a PPO that whitens per batch; the layout is not.

**Epochs over mini-batches** (``rl.ppo_epochs``, ``rl.mini_batches``; the rollout cycles of
``posttrain/rl.py``): ``log q``, ``V^old``, the advantages and the returns are fixed when a rollout is
drawn and reused at each of its updates. At a rollout's first update the ratio is exactly 1 and
``V = V^old``, so neither clip binds (with the default ``E = M = 1`` that is every update: the policy
gradient with GAE advantages and the value regression's); from its second on they do.

Metrics: GRPO's (``rl/reward_mean``, ``rl/reward_std``, ``rl/kl`` as the k3 estimate per completion
token, ``rl/clip_fraction`` of tokens, ``rl/entropy``, ``rl/response_length``, ``rl/failed_rewards``) and
``rl/value_loss`` (the mean of ``l^V`` per completion token) and ``rl/explained_variance`` (of the returns
by the values at sampling, over every completion token since the last record).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.config import ModelConfig
from lmforge.model.loss import head_loss
from lmforge.model.transformer import Transformer
from lmforge.parallel.reduce import sum_over
from lmforge.posttrain.ppo_loss import (
    explained_variance,
    explained_variance_sums,
    gae,
    ppo_loss,
    token_rewards,
    whiten,
)
from lmforge.posttrain.rl import DRAWN, RLObjective, Rollout, at_least_fp32, with_balance_losses
from lmforge.posttrain.rl_data import PromptBatch
from lmforge.posttrain.rl_loss import k3
from lmforge.precision import PrecisionPolicy

VALUE_HEAD = "value_head"


class PolicyValueModel(Transformer):
    """The transformer (language-model head and all) plus ``value_head = Linear(d_model, 1)``; its
    parameter names are the transformer's plus ``value_head.weight`` and ``value_head.bias``."""

    trained_heads = ("value_head",)  # trained in full under LoRA, never wrapped (model/wrap.py)

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        max_seq_len: int,
        attention: str = "auto",
        moe_kernel: str = "auto",
    ):
        super().__init__(cfg, vocab_size, max_seq_len, attention, moe_kernel)
        self.value_head = nn.Linear(cfg.d_model, 1)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(..., d_model)`` -> values ``(...)``. Under tensor parallelism the head's weights
        are replicated DTensors (``parallel/tensor.py``) and ``hidden`` the full hidden states on every rank:
        the local tensors are read, and their gradients, from every token on every rank, are whole."""
        head = self.value_head
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):
            weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
        return F.linear(hidden, weight, bias).squeeze(-1)


def language_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the value head's tensors: the language model's weights alone."""
    return {k: v for k, v in state.items() if not k.startswith(VALUE_HEAD + ".")}


def with_value_head(base: dict[str, torch.Tensor], model: PolicyValueModel) -> dict[str, torch.Tensor]:
    """A PPO run's starting weights: ``base`` (a language model's state) and ``model``'s own initialised
    value head."""
    own = model.state_dict()
    return {**base, **{k: v.detach().cpu() for k, v in own.items() if k.startswith(VALUE_HEAD + ".")}}


class TokenLogpsValues(nn.Module):
    """``model``, its head and value head: ``(inputs, targets, doc_ids) -> (logp, entropy, values)``, each
    ``(B, L)`` float32: ``rl.py::TokenLogps``'s two and ``V`` at every position (with gradient; the
    caller masks it)."""

    def __init__(self, model: PolicyValueModel, chunk: int = 1024):
        super().__init__()
        self.model, self.chunk = model, chunk

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.model(inputs, doc_ids)
        logp = at_least_fp32(-head_loss(self.model, hidden, targets, self.chunk, reduction="none"))
        entropy = torch.zeros_like(logp)
        with torch.no_grad():
            where = targets != -100
            lp = at_least_fp32(self.model.logits(hidden.detach()[where])).log_softmax(-1)
            entropy[where] = -(lp.exp() * lp).sum(-1)
        return logp, entropy, at_least_fp32(self.model.values(hidden))


# per micro-batch, after rl.py's sums: value-loss sum, then explained_variance_sums' five
_PPO_SUMS = 6


class PPOObjective(RLObjective):
    """PPO for a training module (module docstring): ``policy`` a :class:`TokenLogpsValues` (or it
    transformed); sampling, rewards, the reference and evaluation as :class:`RLObjective`'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ppo_sums: torch.Tensor | None = None

    def set_old(self, rollout: Rollout, outputs: tuple[torch.Tensor, ...]) -> None:
        """The old log-probabilities and values of the weights that drew ``rollout`` (``outputs``: the
        policy's ``(logp, entropy, values)`` on its rows), and from them, without gradient, the per-token
        rewards, GAE advantages (whitened per micro-batch with ``rl.whiten_advantages``) and returns."""
        c, mask = self.cfg, rollout.mask
        old_logp, old_values = at_least_fp32(outputs[0]).detach(), at_least_fp32(outputs[2]).detach()
        with torch.no_grad():
            per_token = token_rewards(
                rollout.rewards.to(old_logp.device), old_logp, rollout.ref_logp, mask, c.beta
            )
            adv, returns = gae(per_token, old_values, mask, c.gae_gamma, c.gae_lambda)
            if c.whiten_advantages:
                adv = whiten(adv, mask)
        rollout.old_logp, rollout.old_values, rollout.advantages, rollout.returns = (
            old_logp,
            old_values,
            adv,
            returns,
        )

    def forward_backward(
        self, batch: PromptBatch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """One update on ``batch``'s rollouts: backward of ``sum(group losses) / n_targets * dp``; returns
        ``sum(group losses) / n_targets``, detached (as :meth:`RLObjective.forward_backward`)."""
        c = self.cfg
        ro = self.rollout_of(batch, precision)
        with precision.autocast():
            logp, entropy, values = self.policy(ro.inputs, ro.targets, ro.docs)
        logp, values = at_least_fp32(logp), at_least_fp32(values)
        if ro.old_logp is None:  # drawn in this step by these weights
            self.set_old(ro, (logp, entropy, values))
        mask, ref = ro.mask, ro.ref_logp
        parts = ppo_loss(
            logp, ro.old_logp, values, ro.old_values, ro.returns, ro.advantages, mask, c.group_size,
            c.clip_epsilon, c.value_clip, c.value_coef,
        )  # fmt: skip
        loss = parts.groups.sum() / n_targets
        objective = with_balance_losses(self.policy, loss, ro.prompts, n_targets)
        precision.backward(objective * dp if dp != 1 else objective)
        with torch.no_grad():
            m = mask.float()
            kl = float((k3(logp, ref) * m).sum()) if ref is not None else 0.0
            self._add(
                [kl, float(parts.clipped), float(parts.tokens), float(m.sum()), float((entropy * m).sum())],
                DRAWN,
            )
            extra = torch.cat(
                [
                    parts.value_loss_sum.double().cpu()[None],
                    explained_variance_sums(ro.returns, ro.old_values, mask).cpu(),
                ]
            )
        self._ppo_sums = extra if self._ppo_sums is None else self._ppo_sums + extra
        return loss.detach()

    def take_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """:meth:`RLObjective.take_metrics` and ``rl/value_loss``, ``rl/explained_variance``."""
        extra, self._ppo_sums = self._ppo_sums, None
        out = super().take_metrics(group)
        if extra is None:
            return out
        if group is not None:
            extra = sum_over(extra, group)
        tokens = max(float(extra[1]), 1.0)
        return {
            **out,
            "rl/value_loss": float(extra[0]) / tokens,
            "rl/explained_variance": explained_variance(extra[1:]),
        }
