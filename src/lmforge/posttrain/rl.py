"""RL from rewards: the objective a training step runs through ``train/modules.py::RLModule``.

Each micro-batch of ``k`` prompts (:class:`~lmforge.posttrain.rl_data.PromptBatch`):

1. **sample** ``G = rl.group_size`` completions per prompt with the current policy
   (``model/sampling.py::generate_batch``, key/value cache), seeded from ``train.seed`` and the batch's
   first prompt number, so a resumed run draws what the uninterrupted one drew (under FSDP2, tensor and
   expert parallelism from a whole copy of the weights gathered first, ``parallel/whole_copy.py``; under tensor
   parallelism on the group's first rank, which hands the completions and rewards to the others);
2. **score** them with the reward (``posttrain/reward_pool.py``: a sandboxed function; failed calls
   score ``rl.failed_reward`` and are counted);
3. **advantages** per group and the **loss** of ``posttrain/rl_loss.py`` (formulas there), the policy's
   per-token log-probabilities with gradient (:class:`TokenLogps`), the sampling policy's the same
   detached (one update per batch: ratio 1), the frozen reference's without gradient. Log-probabilities
   and losses are FP32, FP64 under ``train.precision = "fp64"``. An MoE policy's balance losses join the
   loss (:func:`with_balance_losses`).

Metrics (means since the last record, each over what it names): ``rl/reward_mean``, ``rl/reward_std``
(over every completion), ``rl/kl`` (k3 per completion token), ``rl/clip_fraction`` (share of tokens,
RLOO: of sequences, where the clipped term is the one taken), ``rl/entropy`` (mean token entropy of the
policy on the sampled completions, nats), ``rl/response_length`` (tokens, the stop token included),
``rl/failed_rewards`` (failed reward calls, a count). Evaluation: greedy completions of the held-out prompts,
``val_reward`` their mean reward and ``val_loss = -val_reward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import RLConfig
from lmforge.model.loss import head_loss
from lmforge.model.moe import take_aux_loss
from lmforge.model.sampling import generate_batch
from lmforge.model.transformer import Transformer
from lmforge.parallel.reduce import sum_over
from lmforge.posttrain.reward_pool import RewardFn
from lmforge.posttrain.rl_data import PromptBatch, rollout_rows
from lmforge.posttrain.rl_loss import group_advantages, policy_loss
from lmforge.precision import PrecisionPolicy

# summed per micro-batch: groups, completions, reward, reward^2, kl, clipped, clip count, tokens,
# entropy, failed
_SUMS = ("groups", "n", "r", "r2", "kl", "clipped", "clip_n", "tokens", "entropy", "failed")


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in FP32 at least (FP64 stays FP64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class TokenLogps(nn.Module):
    """``model`` and its head: ``(inputs, targets, doc_ids) -> (logp, entropy)``, both ``(B, L)`` float32:
    ``log p(targets[i, t] | inputs[i, :t+1])`` (0 where the target is -100; through the fused head and
    cross-entropy, as the training loss) and, without gradient, the entropy of the model's next-token
    distribution at the target positions (0 elsewhere); FP64 for a float64 model."""

    def __init__(self, model: Transformer, chunk: int = 1024):
        super().__init__()
        self.model, self.chunk = model, chunk

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(inputs, doc_ids)
        logp = at_least_fp32(-head_loss(self.model, hidden, targets, self.chunk, reduction="none"))
        entropy = torch.zeros_like(logp)
        with torch.no_grad():
            where = targets != -100
            logits = at_least_fp32(self.model.logits(hidden.detach()[where]))
            lp = logits.log_softmax(-1)
            entropy[where] = -(lp.exp() * lp).sum(-1)
        return logp, entropy


def with_balance_losses(policy: nn.Module, loss: torch.Tensor, k: int, n_targets: int) -> torch.Tensor:
    """``loss + aux * k / n_targets``: the weighted balance losses ``aux`` of the MoE layers the policy's
    last training forward ran through (``model/moe.py::take_aux_loss``; found inside any wrapper) joined
    with the micro-batch's share of the step's prompts (``k`` of ``n_targets`` over every data-parallel
    rank), so the step trains on their prompt-weighted mean over micro-batches and ranks, as the
    next-token loss weighs them by targets (``train/modules.py::LanguageModelModule``). ``loss`` itself
    without MoE layers or balance losses."""
    aux = take_aux_loss(policy)
    return loss if aux is None else loss + aux.to(loss.dtype) * (k / n_targets)


class RLObjective:
    """GRPO / RLOO for a training module: ``forward_backward`` of a :class:`PromptBatch`, metric sums and
    evaluation. ``policy``: a :class:`TokenLogps` (or it transformed) that training calls; ``sampler``: the
    plain model completions are drawn from; ``reference``: a frozen :class:`TokenLogps` of the starting
    weights (None: set later, or ``rl.beta = 0``); ``stop``: the token that ends a completion;
    ``decode``: ids -> text; ``refresh_sampler``: called before each rollout, every rank in step (under
    FSDP2 and tensor parallelism: ``sampler``'s whole weights gathered from the shards,
    ``parallel/whole_copy.py``).

    ``tp_group``: the tensor-parallel group (None without). Its ranks compute one forward together, so they
    must hold the same rows: its first rank samples and scores each rollout and broadcasts the completions
    and rewards to the others (:meth:`rollout`), rather than trusting every rank to draw the same tokens
    (another device's rounding) and get the same rewards (a reward call that times out on one rank only);
    the rows are padded to a multiple of the group's size (sequence parallelism shards the positions)."""

    def __init__(
        self,
        policy: nn.Module,
        sampler: Transformer,
        cfg: RLConfig,
        reward: RewardFn,
        stop: int,
        decode,
        pad_id: int,
        seed: int,
        reference: nn.Module | None = None,
        refresh_sampler: Callable[[], object] | None = None,
        tp_group: dist.ProcessGroup | None = None,
    ):
        self.policy, self.sampler, self.cfg, self.reward = policy, sampler, cfg, reward
        self.refresh_sampler, self.tp_group = refresh_sampler, tp_group
        self.row_multiple = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.stop, self.decode, self.pad_id, self.seed = stop, decode, pad_id, seed
        self.reference = None
        self.set_reference(reference)
        self._sums: torch.Tensor | None = None
        self.last_error: str | None = None

    def set_reference(self, reference: nn.Module | None) -> None:
        self.reference = reference
        if reference is not None:
            reference.eval().requires_grad_(False)

    @property
    def variant(self) -> str:
        return "rloo" if self.cfg.algorithm == "rloo" else self.cfg.loss

    # -- rollouts ---------------------------------------------------------------------------------

    def sample(self, batch: PromptBatch, greedy: bool = False) -> tuple[list[list[int]], list[list[int]]]:
        """``(rows, completions)``: each prompt repeated ``G`` times (once when ``greedy``) and its completion
        ids, the stop token appended where the completion ended on it."""
        c = self.cfg
        g = 1 if greedy else c.group_size
        rows = [p for p in batch.prompts for _ in range(g)]
        seed = (self.seed * 1_000_003 + batch.position) % (1 << 62)
        temperature = 0.0 if greedy else c.temperature
        if self.refresh_sampler is not None:
            self.refresh_sampler()
        out = generate_batch(
            self.sampler, rows, c.max_new_tokens, temperature, c.top_k, c.top_p, (self.stop,), seed
        )
        return rows, [[*o, self.stop] if len(o) < c.max_new_tokens else o for o in out]

    def rollout(
        self, batch: PromptBatch, greedy: bool = False
    ) -> tuple[list[list[int]], list[list[int]], torch.Tensor, int]:
        """``(rows, completions, rewards, failed)``: :meth:`sample` and :meth:`rewards`; under tensor
        parallelism drawn and scored on the group's first rank and broadcast to the others (every rank
        still enters ``refresh_sampler``'s gathers)."""
        g = 1 if greedy else self.cfg.group_size
        if self.tp_group is None or dist.get_rank(self.tp_group) == 0:
            rows, completions = self.sample(batch, greedy)
            rewards, failed = self.rewards(batch, completions, g)
            if self.tp_group is None:
                return rows, completions, rewards, failed
            shared = [completions, rewards.tolist(), failed, self.last_error]
        else:
            if self.refresh_sampler is not None:
                self.refresh_sampler()
            shared = [None] * 4
        dist.broadcast_object_list(shared, group=self.tp_group, group_src=0)
        completions, rewards, failed, self.last_error = shared
        rows = [p for p in batch.prompts for _ in range(g)]
        return rows, completions, torch.tensor(rewards, dtype=torch.float32), failed

    def rewards(self, batch: PromptBatch, completions: list[list[int]], g: int) -> tuple[torch.Tensor, int]:
        texts = [self.decode([t for t in o if t != self.stop]) for o in completions]
        scores = self.reward.score([t for t in batch.texts for _ in range(g)], texts)
        if scores.first_error is not None:
            self.last_error = scores.first_error
        return torch.tensor(scores.rewards, dtype=torch.float32), scores.failed

    # -- what train_step uses ---------------------------------------------------------------------

    def reference_logps(
        self, inputs: torch.Tensor, targets: torch.Tensor, docs: torch.Tensor, precision: PrecisionPolicy
    ) -> torch.Tensor | None:
        """The frozen reference's per-token log-probabilities of the rollout rows (FP32 at least), or None
        when ``rl.beta`` is 0 (no KL term)."""
        if not self.cfg.beta:
            return None
        if self.reference is None:
            raise RuntimeError("rl.beta > 0 but no reference model was set (RLObjective.set_reference)")
        with torch.no_grad(), precision.autocast():
            return at_least_fp32(self.reference(inputs, targets, docs)[0])

    def forward_backward(
        self, batch: PromptBatch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """Sample, score and backward of ``sum(group losses) / n_targets * dp`` (``n_targets``: the step's
        prompts over all data-parallel ranks); returns ``sum(group losses) / n_targets``, detached."""
        c, device = self.cfg, precision.device
        rows, completions, rewards, failed = self.rollout(batch)
        rowed = rollout_rows(rows, completions, self.pad_id, self.row_multiple)
        inputs, targets, docs = (t.to(device) for t in rowed)
        with precision.autocast():
            logp, entropy = self.policy(inputs, targets, docs)
        ref = self.reference_logps(inputs, targets, docs, precision)
        mask = targets != -100
        k = len(batch.prompts)
        adv_kind = "dr_grpo" if c.algorithm == "grpo" and c.loss == "dr_grpo" else c.algorithm
        adv = group_advantages(rewards.view(k, c.group_size), adv_kind).flatten().to(device)
        logp = at_least_fp32(logp)
        parts = policy_loss(
            logp, logp.detach(), ref, mask, adv, c.group_size, self.variant,
            c.clip_epsilon, c.beta, c.max_new_tokens,
        )  # fmt: skip
        loss = parts.groups.sum() / n_targets
        objective = with_balance_losses(self.policy, loss, k, n_targets)
        precision.backward(objective * dp if dp != 1 else objective)
        with torch.no_grad():
            stats = torch.stack(
                [
                    torch.tensor(float(k)), torch.tensor(float(len(rows))), rewards.sum(), (rewards**2).sum(),
                    parts.kl_sum.cpu(), parts.clipped.cpu(), parts.clip_count.cpu(), mask.sum().float().cpu(),
                    (entropy * mask).sum().cpu(), torch.tensor(float(failed)),
                ]
            )  # fmt: skip
        self._sums = stats if self._sums is None else self._sums + stats
        return loss.detach()

    def take_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Means since the last call (summed over ``group``'s ranks when given), then reset."""
        sums, self._sums = self._sums, None
        if sums is None:
            return {}
        if group is not None:
            sums = sum_over(sums.to(torch.float64), group)
        s = dict(zip(_SUMS, sums.tolist(), strict=True))
        n, tokens = max(s["n"], 1.0), max(s["tokens"], 1.0)
        mean = s["r"] / n
        var = max(s["r2"] / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 1.0)
        return {
            "rl/reward_mean": mean,
            "rl/reward_std": math.sqrt(var),
            "rl/kl": s["kl"] / tokens,
            "rl/clip_fraction": s["clipped"] / max(s["clip_n"], 1.0),
            "rl/entropy": s["entropy"] / tokens,
            "rl/response_length": s["tokens"] / n,
            "rl/failed_rewards": s["failed"],
        }

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[PromptBatch],
        precision: PrecisionPolicy,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, float]:
        """``val_reward``: the mean reward of greedy completions of ``batches``' prompts; ``val_loss`` its
        negative (lower is better, as for the other objectives); ``val_failed_rewards`` a count."""
        total = torch.zeros(3, dtype=torch.float64)
        for batch in batches:
            _, _, rewards, failed = self.rollout(batch, greedy=True)
            total += torch.tensor(
                [float(rewards.sum()), float(len(rewards)), float(failed)], dtype=torch.float64
            )
        if group is not None:
            total = sum_over(total, group)
        reward = float(total[0] / max(float(total[1]), 1.0))
        return {"val_loss": -reward, "val_reward": reward, "val_failed_rewards": float(total[2])}
