"""RL from rewards: the objective a training step runs through ``posttrain/objective_rl.py::RLModule``.

Each micro-batch of ``k`` prompts (:class:`~lmforge.posttrain.rl_data.PromptBatch`):

1. **sample** ``G = rl.group_size`` completions per prompt with the current policy
   (``model/sampling.py::generate_batch``, key/value cache), seeded from ``train.seed`` and the batch's
   first prompt number, so a resumed run draws what the uninterrupted one drew (under FSDP2, tensor and
   expert parallelism from a whole copy of the weights gathered first, ``parallel/whole_copy.py``; under tensor
   parallelism on the group's first rank, which hands the completions and rewards to the others);
2. **score** them with the reward (``posttrain/reward_pool.py``: a sandboxed function; failed calls
   score ``rl.failed_reward`` and are counted);
3. **advantages** per group and the **loss** of ``posttrain/rl_loss.py`` (formulas there), the policy's
   per-token log-probabilities with gradient (:class:`TokenLogps`), the sampling policy's ("old") and
   the frozen reference's without gradient. Log-probabilities and losses are FP32, FP64 under
   ``train.precision = "fp64"``. An MoE policy's balance losses join the loss (:func:`with_balance_losses`).

**Rollout cycles** (``rl.ppo_epochs = E``, ``rl.mini_batches = M``; PPO's epochs over mini-batches,
GRPO's ``mu`` iterations): the rollouts of ``M`` steps' prompts are drawn in the cycle's first step, from
its weights, and each is trained on at ``E`` steps (``rl_data.py`` gives the order). A :class:`Rollout`
keeps what is fixed when it is drawn: its rows, rewards, the reference's log-probabilities and the old
log-probabilities ``log q`` of the weights that sampled it (PPO: the old values, advantages and returns
too). The micro-batch trained on in the step that draws it takes ``log q`` from that step's own forward,
detached (the same weights: its ratio is exactly 1); the others drawn ahead get it from a forward without
gradient in eval mode (so that the MoE layers count no routing for it), before any update. From the
second update of a rollout on, the policy has moved, the ratio differs from 1 and ``rl.clip_epsilon``
(PPO: ``rl.value_clip``) binds. With ``E = M = 1`` (the default) each rollout is trained on once, in the
step that draws it, at ratio 1, and nothing is kept. The rollouts kept between steps are this rank's
part of the checkpoint (``train/checkpoint.py``: ``rollouts/rank_K.pt``), so a resume inside a cycle
trains on what the uninterrupted run would.

Metrics (means since the last record, each over what it names): ``rl/reward_mean``, ``rl/reward_std``
(over every completion), ``rl/kl`` (k3 per completion token), ``rl/clip_fraction`` (share of tokens,
RLOO: of sequences, where the clipped term is the one taken), ``rl/entropy`` (mean token entropy of the
policy on the sampled completions, nats), ``rl/response_length`` (tokens, the stop token included),
``rl/failed_rewards`` (failed reward calls, a count). The rewards, lengths and failures count each rollout
once, when it is drawn (a record with no rollout drawn since the last has none of them); the KL, clip
fraction and entropy each update. Evaluation: greedy completions of the held-out prompts,
``val_reward`` their mean reward and ``val_loss = -val_reward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields

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

# summed per micro-batch: of its rollouts when drawn (groups, completions, reward, reward^2, failed, completion
# tokens), then of each update (kl, clipped, clip count, tokens trained on, entropy)
_SUMS = ("groups", "n", "r", "r2", "failed", "length", "kl", "clipped", "clip_n", "tokens", "entropy")
DRAWN = 6  # the first six are the rollouts'


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


@dataclass
class Rollout:
    """One micro-batch's rollouts, fixed when drawn: the rows (``rl_data.py::rollout_rows``), the rewards
    ``(N,)``, the reference's log-probabilities (None without a KL term) and, once known, the sampling
    weights' ``old_logp``; PPO adds ``old_values``, ``advantages``, ``returns`` (``posttrain/ppo.py``).
    ``prompts``: the micro-batch's prompt count."""

    inputs: torch.Tensor
    targets: torch.Tensor
    docs: torch.Tensor
    rewards: torch.Tensor
    prompts: int
    ref_logp: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.targets != -100

    def state_dict(self) -> dict:
        return {f.name: _on_cpu(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> Rollout:
        return cls(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()})


def _on_cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


@dataclass
class RolloutBuffer:
    """The rollouts of the current cycle kept for its later updates, by their micro-batch's first prompt
    number (``PromptBatch.position``)."""

    rollouts: dict[int, Rollout] = field(default_factory=dict)
    cycle: int = -1  # the first prompt number of the cycle they belong to

    def state_dict(self) -> dict:
        if not self.rollouts:
            return {}
        return {"cycle": self.cycle, "rollouts": {p: r.state_dict() for p, r in self.rollouts.items()}}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.cycle = int(state.get("cycle", -1))
        self.rollouts = {int(p): Rollout.from_state(r, device) for p, r in state.get("rollouts", {}).items()}


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
        self.buffer = RolloutBuffer()

    def set_reference(self, reference: nn.Module | None) -> None:
        self.reference = reference
        if reference is not None:
            reference.eval().requires_grad_(False)

    @property
    def variant(self) -> str:
        return "rloo" if self.cfg.algorithm == "rloo" else self.cfg.loss

    # -- rollouts ---------------------------------------------------------------------------------

    def sample(
        self, batch: PromptBatch, greedy: bool = False, refresh: bool = True
    ) -> tuple[list[list[int]], list[list[int]]]:
        """``(rows, completions)``: each prompt repeated ``G`` times (once when ``greedy``) and its completion
        ids, the stop token appended where the completion ended on it; ``refresh``: bring the sampler up to
        date first (False: it is, the weights have not changed since the last rollout)."""
        c = self.cfg
        g = 1 if greedy else c.group_size
        rows = [p for p in batch.prompts for _ in range(g)]
        seed = (self.seed * 1_000_003 + batch.position) % (1 << 62)
        temperature = 0.0 if greedy else c.temperature
        if refresh and self.refresh_sampler is not None:
            self.refresh_sampler()
        out = generate_batch(
            self.sampler, rows, c.max_new_tokens, temperature, c.top_k, c.top_p, (self.stop,), seed
        )
        return rows, [[*o, self.stop] if len(o) < c.max_new_tokens else o for o in out]

    def rollout(
        self, batch: PromptBatch, greedy: bool = False, refresh: bool = True
    ) -> tuple[list[list[int]], list[list[int]], torch.Tensor, int]:
        """``(rows, completions, rewards, failed)``: :meth:`sample` and :meth:`rewards`; under tensor
        parallelism drawn and scored on the group's first rank and broadcast to the others (every rank
        still enters ``refresh_sampler``'s gathers)."""
        g = 1 if greedy else self.cfg.group_size
        if self.tp_group is None or dist.get_rank(self.tp_group) == 0:
            rows, completions = self.sample(batch, greedy, refresh)
            rewards, failed = self.rewards(batch, completions, g)
            if self.tp_group is None:
                return rows, completions, rewards, failed
            shared = [completions, rewards.tolist(), failed, self.last_error]
        else:
            if refresh and self.refresh_sampler is not None:
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

    def draw(self, batch: PromptBatch, precision: PrecisionPolicy, refresh: bool = True) -> Rollout:
        """Sample and score ``batch``'s rollouts, their rows on the device and the reference's
        log-probabilities; their rewards, lengths and failures join the metric sums."""
        rows, completions, rewards, failed = self.rollout(batch, refresh=refresh)
        rowed = rollout_rows(rows, completions, self.pad_id, self.row_multiple)
        inputs, targets, docs = (t.to(precision.device) for t in rowed)
        ref = self.reference_logps(inputs, targets, docs, precision)
        drawn = Rollout(inputs, targets, docs, rewards, len(batch.prompts), ref)
        self._add(
            [
                float(len(batch.prompts)), float(len(rows)), float(rewards.sum()), float((rewards**2).sum()),
                float(failed), float(drawn.mask.sum()),
            ],
            0,
        )  # fmt: skip
        return drawn

    def set_old(self, rollout: Rollout, outputs: tuple[torch.Tensor, ...]) -> None:
        """``rollout``'s figures of the weights that drew it, from the policy's ``outputs`` on its rows
        (detached): the old log-probabilities (PPO also its old values, advantages and returns)."""
        rollout.old_logp = at_least_fp32(outputs[0]).detach()

    def rollout_of(self, batch: PromptBatch, precision: PrecisionPolicy) -> Rollout:
        """The rollouts this step trains on: at a cycle's first update drawn now (those of the later
        mini-batches too, kept with their old figures from a forward without gradient), else kept."""
        last_pass = batch.update >= (self.cfg.ppo_epochs - 1) * self.cfg.mini_batches
        if batch.update > 0:
            kept = self.buffer.rollouts.pop if last_pass else self.buffer.rollouts.get
            rollout = kept(batch.position, None)
            if rollout is None:
                raise RuntimeError(
                    f"rl: no rollouts kept for the prompts from {batch.position} (update {batch.update} of a "
                    "cycle); the checkpoint resumed from holds no rollout buffer for this rank"
                )
            return rollout
        if batch.cycle != self.buffer.cycle:  # a new cycle: the last one's rollouts are spent
            self.buffer.rollouts.clear()
            self.buffer.cycle = batch.cycle
        rollout = self.draw(batch, precision)
        for later in batch.ahead:
            kept = self.draw(later, precision, refresh=False)  # the same weights: no new gather
            with torch.no_grad(), precision.autocast():
                was = self.policy.training
                self.policy.eval()
                try:
                    self.set_old(kept, self.policy(kept.inputs, kept.targets, kept.docs))
                finally:
                    self.policy.train(was)
            self.buffer.rollouts[later.position] = kept
        if not last_pass:
            self.buffer.rollouts[batch.position] = rollout
        return rollout

    def forward_backward(
        self, batch: PromptBatch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """One update on ``batch``'s rollouts (:meth:`rollout_of`): backward of ``sum(group losses) /
        n_targets * dp`` (``n_targets``: the step's prompts over all data-parallel ranks); returns
        ``sum(group losses) / n_targets``, detached."""
        c, device = self.cfg, precision.device
        ro = self.rollout_of(batch, precision)
        with precision.autocast():
            logp, entropy = self.policy(ro.inputs, ro.targets, ro.docs)
        logp = at_least_fp32(logp)
        if ro.old_logp is None:  # drawn in this step by these weights
            self.set_old(ro, (logp,))
        mask, k = ro.mask, ro.prompts
        adv_kind = "dr_grpo" if c.algorithm == "grpo" and c.loss == "dr_grpo" else c.algorithm
        adv = group_advantages(ro.rewards.view(k, c.group_size), adv_kind).flatten().to(device)
        parts = policy_loss(
            logp, ro.old_logp, ro.ref_logp, mask, adv, c.group_size, self.variant,
            c.clip_epsilon, c.beta, c.max_new_tokens,
        )  # fmt: skip
        loss = parts.groups.sum() / n_targets
        objective = with_balance_losses(self.policy, loss, k, n_targets)
        precision.backward(objective * dp if dp != 1 else objective)
        with torch.no_grad():
            self._add(
                [
                    float(parts.kl_sum), float(parts.clipped), float(parts.clip_count),
                    float(mask.sum()), float((entropy * mask).sum()),
                ],
                DRAWN,
            )  # fmt: skip
        return loss.detach()

    def _add(self, values: list[float], at: int) -> None:
        """Add ``values`` to the metric sums from index ``at``."""
        if self._sums is None:
            self._sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        self._sums[at : at + len(values)] += torch.tensor(values, dtype=torch.float64)

    def state_dict(self) -> dict:
        """This rank's rollouts kept for the cycle's later updates (empty between cycles)."""
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state, next(self.sampler.parameters()).device)

    def take_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Means since the last call (summed over ``group``'s ranks when given), then reset."""
        sums, self._sums = self._sums, None
        if sums is None:
            return {}
        if group is not None:
            sums = sum_over(sums.to(torch.float64), group)
        s = dict(zip(_SUMS, sums.tolist(), strict=True))
        tokens = max(s["tokens"], 1.0)
        out = {
            "rl/kl": s["kl"] / tokens,
            "rl/clip_fraction": s["clipped"] / max(s["clip_n"], 1.0),
            "rl/entropy": s["entropy"] / tokens,
        }
        if s["n"]:  # rollouts were drawn since the last record (in a cycle: at its first step only)
            n = s["n"]
            mean = s["r"] / n
            var = max(s["r2"] / n - mean * mean, 0.0) * (n / (n - 1) if n > 1 else 1.0)
            out |= {
                "rl/reward_mean": mean,
                "rl/reward_std": math.sqrt(var),
                "rl/response_length": s["length"] / n,
                "rl/failed_rewards": s["failed"],
            }
        return out

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
