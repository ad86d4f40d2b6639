"""Reward models: a scalar head on the transformer, trained on preference pairs with the Bradley-Terry
loss; the objective a training step runs through ``posttrain/objective_reward.py::RewardModule``.

**The model** (:class:`RewardModel`): the plain :class:`~lmforge.model.transformer.Transformer` with its
language-model head replaced by ``score = Linear(d_model, 1, bias=False)``. The reward of a sequence is
``score(h_last)``, ``h_last`` the final hidden state (after the final norm) at the sequence's **last real
token**: the rightmost position whose id is not the padding id (:func:`last_token_index`). Why that token:
under causal attention it is the only position that has seen the whole prompt and response, and it is the
token ``transformers``' ``LlamaForSequenceClassification`` / ``GPT2ForSequenceClassification`` pool (in
transformers 5.24, ``(arange(T) * (input_ids != pad_token_id)).argmax(-1)``: the rightmost non-pad
token), so the exported model (``pad_token_id`` = lmforge's ``<|endoftext|>``, the padding id here) scores
exactly what lmforge scores. A rendered chat sequence ends with ``<|end|>\\n``, never with the padding id.
No bias: the Hugging Face classes' ``score`` has none, and a constant added to every reward cancels in
the loss anyway. Rows are right-padded and attention is plain causal, so padding never reaches the
scored position.

**The loss** (:func:`bradley_terry_loss`), per pair, with ``r_c``, ``r_r`` the rewards of the chosen and
rejected sequences and ``m`` a margin::

    L = -log sigmoid(r_c - r_r - m)

the negative log-likelihood of the preference under the Bradley-Terry model
``P(chosen > rejected) = sigmoid(r_c - r_r)`` (Ouyang et al. 2022, "Training language models to follow
instructions with human feedback", eq. 1), with Llama 2's margin (Touvron et al. 2023, "Llama 2", eq. 2):
``m`` is the record's ``margin`` field, else ``reward.margin`` (0: the plain loss). ``m > 0`` asks the
chosen response to win by at least about ``m``. The step's loss is the mean over the pairs of the step.

Metrics (means over the pairs since the last record; ``val_`` on held-out pairs, with ``val_loss``):
``rewards/accuracies`` (share of pairs with ``r_c > r_r``: a tie counts as wrong), ``rewards/margins``
(``r_c - r_r``), ``rewards/chosen``, ``rewards/rejected``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.posttrain.dpo import pair_means
from lmforge.posttrain.dpo_data import PairLoader, PairRows, TokenizedPair, row_width
from lmforge.precision import PrecisionPolicy

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class RewardModel(Transformer):
    """The transformer with a scalar head ``score`` (``Linear(d_model, 1, bias=False)``) in place of the
    language-model head; parameter names are the transformer's plus ``score.weight``, so a language
    model's checkpoint fills everything but the head (:func:`start_state`)."""

    trained_heads = ("score",)  # trained in full under LoRA, never wrapped (model/wrap.py)

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        max_seq_len: int,
        attention: str = "auto",
        moe_kernel: str = "auto",
    ):
        super().__init__(cfg, vocab_size, max_seq_len, attention, moe_kernel)
        self.lm_head = None  # not trained, not exported: a reward model scores, it does not generate
        self.score = nn.Linear(cfg.d_model, 1, bias=False)

    def rewards(self, inputs: torch.Tensor, pad_id: int) -> torch.Tensor:
        """Token ids ``(B, T)``, right-padded with ``pad_id`` -> rewards ``(B,)`` (the compute dtype)."""
        hidden = self(inputs)
        last = last_token_index(inputs, pad_id)
        return self.score(hidden[torch.arange(inputs.shape[0], device=inputs.device), last]).squeeze(-1)


def last_token_index(inputs: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``(B,)`` index of each row's rightmost id that is not ``pad_id`` (0 for a row of padding only):
    ``transformers``' rule for sequence classification, so lmforge and the export pool the same token."""
    non_pad = (inputs != pad_id).to(torch.int32)
    positions = torch.arange(inputs.shape[-1], device=inputs.device, dtype=torch.int32)
    return (positions * non_pad).argmax(-1)


def start_state(base: dict[str, torch.Tensor], model: RewardModel) -> dict[str, torch.Tensor]:
    """A reward model's starting weights: ``base`` (a language model's state) for every tensor the reward
    model has (its language-model head dropped; a QLoRA layer takes the full-precision weight and
    quantises it, ``model/lora.py``), ``model``'s own initialised ``score.weight`` for the head."""
    own = model.state_dict()
    state = {k: v for k, v in base.items() if not k.startswith("lm_head.")}
    state["score.weight"] = own["score.weight"].detach().cpu()
    return state


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Per-pair ``-log sigmoid(chosen - rejected - margin)`` (see the module docstring); ``log 2`` for
    equal rewards and no margin."""
    return -F.logsigmoid(chosen - rejected - margin)


class RewardScores(nn.Module):
    """``model``'s rewards as a module (what the layout transformations wrap and a step calls):
    ``(inputs, targets=None, doc_ids=None) -> (B,)`` float32; targets and document ids are ignored (a
    row is one sequence, attention is causal)."""

    def __init__(self, model: RewardModel, pad_id: int):
        super().__init__()
        self.model, self.pad_id = model, pad_id

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model.rewards(inputs, self.pad_id).float()


# -- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardPair:
    """A tokenized pair (its ids the whole sequences, ``<= data.seq_len``) and its loss margin."""

    pair: TokenizedPair
    margin: float


def reward_pairs(pairs: Sequence, tokenized: Sequence[TokenizedPair], margin: float) -> list[RewardPair]:
    """``tokenized`` with each record's margin (``pairs``: the records, with ``.source`` and ``.margin``;
    ``margin``: for records without one)."""
    by_source = {p.source: p.margin for p in pairs}
    out = []
    for t in tokenized:
        m = by_source.get(t.source)
        out.append(RewardPair(t, margin if m is None else m))
    return out


@dataclass
class RewardBatch(PairRows):
    """The reward model's rows (right-padded; ``targets`` all -100, unused) and the ``k`` pairs'
    margins."""

    margin: torch.Tensor | None = None


def stack_reward_pairs(pairs: Sequence[RewardPair], seq_len: int, pad_id: int) -> RewardBatch:
    """The batch of ``pairs``: whole sequences padded with ``pad_id`` to :func:`row_width` of the
    longest (document id 1 on padding, as the DPO rows)."""
    seqs = [p.pair.chosen_ids for p in pairs] + [p.pair.rejected_ids for p in pairs]
    width = row_width(max(len(s) for s in seqs), seq_len)
    inputs = np.full((len(seqs), width), pad_id, dtype=np.int64)
    docs = np.ones((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        inputs[i, : len(s)] = s
        docs[i, : len(s)] = 0
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    inputs_t = torch.from_numpy(inputs)
    return RewardBatch(inputs_t, torch.full_like(inputs_t, -100), torch.from_numpy(docs), margin)


class RewardPairLoader(PairLoader):
    """:class:`~lmforge.posttrain.dpo_data.PairLoader`'s order (a pure function of seed, position and
    rank: exact resume) over :class:`RewardPair` s, giving :class:`RewardBatch` es."""

    def next_batch(self) -> RewardBatch:
        first = self.position + self.rank * self.mbs
        index = [self._pair_of(j) for j in range(first, first + self.mbs)]
        self.position += self.world * self.mbs
        return stack_reward_pairs([self.pairs[i] for i in index], self.seq_len, self.pad_id)


def reward_eval_batches(
    pairs: Sequence[RewardPair], seq_len: int, batch_size: int, pad_id: int, rank: int = 0, world: int = 1
) -> Iterator[RewardBatch]:
    """Every pair once, in order, ``batch_size`` pairs a batch; rank ``r`` of ``world`` takes pairs
    ``r, r + world, ...``."""
    mine = np.arange(rank, len(pairs), world)
    for start in range(0, len(mine), batch_size):
        yield stack_reward_pairs([pairs[i] for i in mine[start : start + batch_size]], seq_len, pad_id)


# -- the objective ---------------------------------------------------------------------------------


class RewardObjective:
    """The reward model's training for ``posttrain/objective_reward.py::RewardModule``: ``scorer`` is the
    transformed :class:`RewardScores` training calls, ``eval_scorer`` the one evaluation calls (default
    ``scorer``)."""

    def __init__(self, scorer: nn.Module, eval_scorer: nn.Module | None = None):
        self.scorer = scorer
        self.eval_scorer = eval_scorer if eval_scorer is not None else scorer
        self._sums: torch.Tensor | None = None  # pairs, loss, then one sum per METRIC_NAMES

    def forward_backward(
        self, batch: RewardBatch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """Backward of ``sum(pair losses) / n_targets * dp`` (``n_targets``: pairs of the whole step over
        all data-parallel ranks); returns ``sum(pair losses) / n_targets``, detached."""
        losses, stats = self._pair_losses(self.scorer, batch, precision)
        loss = losses.sum() / n_targets
        precision.backward(loss * dp if dp != 1 else loss)
        self._sums = stats if self._sums is None else self._sums + stats
        return loss.detach()

    def take_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Means over the pairs since the last call (summed over ``group``'s ranks), then reset."""
        sums, self._sums = self._sums, None
        return pair_means(sums, group, "", None, METRIC_NAMES)

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[RewardBatch],
        precision: PrecisionPolicy,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, float]:
        """``val_loss`` and ``val_rewards/...`` over every pair of ``batches`` (pairs not trained on), in
        eval mode and the run's autocast; the training sums are left alone."""
        was_training = self.eval_scorer.training
        self.eval_scorer.eval()
        sums = None
        try:
            for batch in batches:
                _, stats = self._pair_losses(self.eval_scorer, batch.to(precision.device), precision)
                sums = stats if sums is None else sums + stats
        finally:
            self.eval_scorer.train(was_training)
        return pair_means(sums, group, "val_", "val_loss", METRIC_NAMES)

    def _pair_losses(
        self, scorer: nn.Module, batch: RewardBatch, precision: PrecisionPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses (with gradient) and ``[pairs, loss, *METRIC_NAMES]`` summed (no gradient)."""
        with precision.autocast():
            r = scorer(batch.inputs, batch.targets, batch.doc_ids)
        r = r.float()
        k = batch.n_pairs
        chosen, rejected = r[:k], r[k:]
        losses = bradley_terry_loss(chosen, rejected, batch.margin)
        with torch.no_grad():
            c, rj = chosen.detach(), rejected.detach()
            per_pair = torch.stack([losses.detach(), c, rj, c - rj, (c > rj).float()]).sum(dim=1)
            stats = torch.cat([per_pair.new_tensor([k]), per_pair])
        return losses, stats
