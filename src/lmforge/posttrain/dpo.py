"""Direct preference optimisation: the preference losses, sequence log-probabilities and the objective
a training step runs through ``posttrain/objective_dpo.py::DPOModule``
(:meth:`DPOObjective.forward_backward`).

The policy scores the ``2k`` rows of a :class:`~lmforge.posttrain.dpo_data.PairBatch` (chosen, then
rejected) with :class:`SequenceLogps`: ``log p(response)`` summed over the response tokens. The
reference's scores come from the batch (``dpo.reference = "cached"``: computed once by
``dpo_data.reference_logps``) or from a frozen copy of the starting model (``"model"``). The step's loss
is the mean over the pairs of the whole step (all micro-batches, all data-parallel ranks).

Metrics carry TRL's names (``DPOTrainer``): means over the pairs since the last
:meth:`DPOObjective.take_metrics`, see :data:`METRIC_NAMES`. Evaluation on held-out pairs
(:meth:`DPOObjective.evaluate`) gives the same figures and the loss with lmforge's ``val_`` prefix
(``val_loss``, ``val_rewards/margins``, ...; TRL writes ``eval_``): an evaluation record is the one with
``val_loss`` (``docs/metrics.md``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lmforge.config import DPOConfig
from lmforge.errors import ConfigError
from lmforge.model.loss import head_loss
from lmforge.model.transformer import Transformer
from lmforge.posttrain.dpo_data import PairBatch
from lmforge.precision import PrecisionPolicy

LOSSES = ("sigmoid", "ipo", "hinge")
METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def check_dpo(cfg: DPOConfig) -> None:
    """Refuse settings the losses do not define (before any work)."""
    if cfg.loss == "ipo" and cfg.label_smoothing > 0:
        raise ConfigError(
            "dpo.label_smoothing: the ipo loss has no label smoothing; set it to 0 or use dpo.loss = sigmoid/hinge"
        )


def preference_loss(
    pc: torch.Tensor,
    pr: torch.Tensor,
    rc: torch.Tensor,
    rr: torch.Tensor,
    beta: float,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and the implicit rewards.

    ``pc``, ``pr``: the policy's log-probabilities of the chosen and rejected responses; ``rc``, ``rr``:
    the reference's. With ``h = (pc - rc) - (pr - rr)`` (how much more the policy prefers the chosen
    response than the reference does), ``b = beta`` and ``e = label_smoothing``:

    * ``sigmoid`` (DPO, Rafailov et al. 2023, eq. 7; with ``e > 0`` the conservative DPO of Mitchell
      2023, as TRL): ``L = -(1 - e) log sigmoid(b h) - e log sigmoid(-b h)``, the expected loss when a
      share ``e`` of the labels is flipped;
    * ``ipo`` (IPO, Azar et al. 2023, eq. 17): ``L = (h - 1 / (2 b))^2``; no label smoothing (``e`` must be
      0). The caller passes log-probabilities *averaged* over the response tokens for IPO (as TRL), so the
      target ``1 / (2 b)`` does not depend on response length (:class:`DPOObjective` does);
    * ``hinge`` (SLiC, Zhao et al. 2023, as TRL's ``hinge``): ``L = (1 - e) relu(1 - b h) + e relu(1 + b h)``,
      the same expected loss under flipped labels (``e = 0``: TRL's).

    Returns ``(L, b (pc - rc), b (pr - rr))``, each of the inputs' shape; the rewards carry no gradient.
    ``h = 0`` gives ``log 2`` (sigmoid, any ``e``), ``1 / (4 b^2)`` (ipo) and 1 (hinge).
    """
    h = (pc - rc) - (pr - rr)
    if loss == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss == "ipo":
        if label_smoothing:
            raise ValueError("the ipo loss has no label smoothing")
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss == "hinge":
        losses = (1 - label_smoothing) * F.relu(1 - beta * h) + label_smoothing * F.relu(1 + beta * h)
    else:
        raise ValueError(f"unknown preference loss {loss!r}; one of {LOSSES}")
    return losses, beta * (pc - rc).detach(), beta * (pr - rr).detach()


class SequenceLogps(nn.Module):
    """``model`` and its head: ``(inputs, targets, doc_ids) -> (B,)`` float32, row ``i`` the sum of
    ``log p(targets[i, t] | inputs[i, :t+1])`` over the targets ``!= -100``.

    The per-token values come from the fused head and cross-entropy (``model/loss.py::head_loss`` with
    ``reduction="none"``, ``chunk`` tokens at a time, ``0``: all at once), the same computation as the
    next-token loss, so ``-sum(SequenceLogps)`` is its loss sum: no (tokens x vocab) logits or
    log-probabilities are kept for backward, only the hidden states and one log-sum-exp per token.
    """

    def __init__(self, model: Transformer, chunk: int = 1024):
        super().__init__()
        self.model = model
        self.chunk = chunk

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.model(inputs, doc_ids)
        return -head_loss(self.model, hidden, targets, self.chunk, reduction="none").sum(dim=1)


class DPOObjective:
    """DPO for a training module (``posttrain/objective_dpo.py::DPOModule``): ``forward_backward`` of a
    :class:`PairBatch`, metric sums, and evaluation. ``policy``: a :class:`SequenceLogps` (or it wrapped
    by compile / DDP / FSDP2) that training calls; ``eval_policy``: the one evaluation calls (default:
    ``policy``; an eager one where training's is compiled); ``reference``: a frozen scorer
    (``dpo.reference = "model"``) or None (the batch's ``ref_logps``)."""

    def __init__(
        self,
        policy: nn.Module,
        beta: float,
        loss: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference: nn.Module | None = None,
        eval_policy: nn.Module | None = None,
    ):
        if loss not in LOSSES:
            raise ValueError(f"unknown preference loss {loss!r}; one of {LOSSES}")
        self.policy, self.beta, self.loss, self.label_smoothing = policy, beta, loss, label_smoothing
        self.eval_policy = eval_policy if eval_policy is not None else policy
        self.reference = reference
        if reference is not None:
            reference.eval().requires_grad_(False)
        self._sums: torch.Tensor | None = None  # pairs, loss, then one sum per METRIC_NAMES

    @classmethod
    def from_config(
        cls,
        policy: nn.Module,
        cfg: DPOConfig,
        reference: nn.Module | None = None,
        eval_policy: nn.Module | None = None,
    ) -> DPOObjective:
        check_dpo(cfg)
        return cls(policy, cfg.beta, cfg.loss, cfg.label_smoothing, reference, eval_policy)

    # -- what train_step and the trainer use -------------------------------------------------------

    def forward_backward(
        self, batch: PairBatch, n_targets: int, dp: int, precision: PrecisionPolicy
    ) -> torch.Tensor:
        """Backward of ``sum(pair losses) / n_targets * dp`` (``n_targets``: pairs of the whole step over
        all data-parallel ranks); returns ``sum(pair losses) / n_targets``, detached."""
        losses, stats = self._pair_losses(self.policy, batch, precision)
        loss = losses.sum() / n_targets
        precision.backward(loss * dp if dp != 1 else loss)
        self._sums = _add(self._sums, stats)
        return loss.detach()

    def take_metrics(self, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Means over the pairs since the last call (summed over ``group``'s ranks when given), then
        reset; empty when no pair was seen."""
        sums, self._sums = self._sums, None
        return pair_means(sums, group, prefix="", loss_name=None)

    @torch.no_grad()
    def evaluate(
        self, batches: Iterable[PairBatch], precision: PrecisionPolicy, group: dist.ProcessGroup | None = None
    ) -> dict[str, float]:
        """``val_loss`` and ``val_<metric>`` (means over every pair of ``batches``, summed over ``group``'s
        ranks when given), by ``eval_policy`` in eval mode and the run's autocast; the training sums are
        left alone."""
        was_training = self.eval_policy.training
        self.eval_policy.eval()
        sums = None
        try:
            for batch in batches:
                _, stats = self._pair_losses(self.eval_policy, batch.to(precision.device), precision)
                sums = _add(sums, stats)
        finally:
            self.eval_policy.train(was_training)
        return pair_means(sums, group, prefix="val_", loss_name="val_loss")

    # -- the computation ---------------------------------------------------------------------------

    def _reference(self, batch: PairBatch, precision: PrecisionPolicy) -> torch.Tensor:
        if self.reference is not None:
            with torch.no_grad(), precision.autocast():
                return self.reference(batch.inputs, batch.targets, batch.doc_ids).float()
        if batch.ref_logps is None:
            raise RuntimeError("cached reference: the batch has no ref_logps (PairLoader.set_reference)")
        return batch.ref_logps.float()

    def _pair_losses(
        self, policy: nn.Module, batch: PairBatch, precision: PrecisionPolicy
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses of ``policy`` (with gradient) and the stats ``[pairs, loss, *METRIC_NAMES]``
        summed over the batch's pairs (no gradient)."""
        with precision.autocast():
            logps = policy(batch.inputs, batch.targets, batch.doc_ids)
        logps, ref = logps.float(), self._reference(batch, precision)
        if self.loss == "ipo":  # per-token averages (see preference_loss)
            tokens = (batch.targets != -100).sum(dim=1).clamp(min=1)
            logps, ref = logps / tokens, ref / tokens
        k = batch.n_pairs
        losses, chosen, rejected = preference_loss(
            logps[:k], logps[k:], ref[:k], ref[k:], self.beta, self.loss, self.label_smoothing
        )
        with torch.no_grad():
            per_pair = torch.stack(
                [
                    losses.detach(),
                    chosen,
                    rejected,
                    chosen - rejected,
                    (chosen > rejected).float(),
                    logps[:k].detach(),
                    logps[k:].detach(),
                ]
            ).sum(dim=1)
            stats = torch.cat([per_pair.new_tensor([k]), per_pair])
        return losses, stats


def _add(sums: torch.Tensor | None, stats: torch.Tensor) -> torch.Tensor:
    return stats if sums is None else sums + stats


def pair_means(
    sums: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    prefix: str,
    loss_name: str | None,
    names: tuple[str, ...] = METRIC_NAMES,
) -> dict[str, float]:
    """``{prefix + name: sum / pairs}`` for ``names`` (and the loss under ``loss_name``) from
    ``[pairs, loss, *names]`` summed over the pairs (and over ``group``'s ranks)."""
    if sums is None:
        return {}
    if group is not None:
        sums = sums.clone()
        dist.all_reduce(sums, group=group)
    values = sums.tolist()
    pairs = max(values[0], 1.0)
    out = {prefix + name: v / pairs for name, v in zip(names, values[2:], strict=True)}
    if loss_name is not None:
        out = {loss_name: values[1] / pairs, **out}
    return out
