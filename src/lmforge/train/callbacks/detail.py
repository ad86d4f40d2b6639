"""Detail records: where in the model the gradients, weights, updates, activations and attention stand.

Every ``metrics.detail_interval`` steps (``step % interval == 0``; not at step 1, never with 0), on a
step that was taken, one record ``{"step": N, "detail": True, ...}`` (names and formulas:
``docs/metrics.md``; the formulas: below):

* ``grad_norm/<part>``: gradients after unscaling and before clipping, read in :meth:`veto` (the step
  calls it after ``precision.unscale_`` and the global norm, before clipping and the optimizer step; this
  callback never vetoes), so ``sum_kind grad_norm/kind^2`` is the step record's ``grad_norm^2``;
* ``param_norm`` and ``param_norm/<part>``: the parameters after step N;
* ``update_ratio`` and ``update_ratio/<part>``: ``||theta_after - theta_before|| / ||theta_before||``; a
  copy of this process's parameters (its shards) is taken in :meth:`veto` of a detail step only and
  dropped after the step: one extra copy of the parameters while the optimizer steps;
* ``act_rms/block.<i>`` and ``attn_entropy/layer.<i>``, ``attn_entropy``: one extra forward, no grad, in
  eval mode and the run's autocast, after the step, of the step's first micro-batch (kept from
  :meth:`on_batches`) through the evaluation objective (the FSDP2 root, so its parameters are gathered).
  The forward runs eager (``torch.compiler.set_stance("force_eager")``): blocks compiled in place would
  otherwise recompile for the hooks on every detail step. ``act_rms``: over the whole micro-batch;
  attention entropy: every row of every head of the micro-batch's first sequence, from q and k after
  RoPE taken by ``Attention.probe`` (set only during this forward).

Every rank runs this callback (the norms of sharded parameters and the measuring forward under FSDP2 are
collectives); only the main process's sinks write the record. Under pipeline parallelism each stage
holds other parts and the norms are summed over the ``pp`` group (a tied embedding held by the first and
the last stage counted once, on the first's rank); there, and under tensor parallelism,
there is no ``act_rms`` or ``attn_entropy`` (no single process runs the whole forward).

The formulas (pure functions below the callback): which part of the model a parameter belongs to, norms
per part, the update ratio, the RMS of an activation and the entropy of attention rows.

Parts: each parameter belongs to its block ``block.<i>`` (``blocks.<i>.``...; none outside the blocks)
and to one kind: ``embedding`` (token and, for GPT-2, position embeddings), ``attention`` (q, k, v, o
projections), ``mlp``, ``norm`` (the blocks' norms and the final norm) and ``head`` (an untied output
head; a tied one is the embedding's tensor and counted there once). The kinds partition the parameters,
so ``sum_kind n_kind^2 = n^2`` for any of the norms below.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lmforge.data.loader import Batch
from lmforge.model.attention import document_causal_mask
from lmforge.optim.clip import total_norm
from lmforge.train.callbacks import Callback
from lmforge.train.step import Action, StepResult
from lmforge.train.trainer import Trainer


def is_detail_step(step: int, interval: int) -> bool:
    """Whether step ``step`` (counted from 1) gets a detail record: ``interval > 0 and step % interval == 0``."""
    return interval > 0 and step % interval == 0


class DetailMetrics(Callback):
    """The detail record every ``metrics.detail_interval`` steps (module docstring)."""

    def __init__(self) -> None:
        self._batch: Batch | None = None
        self._grad_norms: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None

    # -- the step ------------------------------------------------------------------------------------

    def _due(self, trainer: Trainer) -> bool:
        """Whether the step being attempted (``progress.step + 1``) is a detail step."""
        return is_detail_step(trainer.progress.step + 1, trainer.run.cfg.metrics.detail_interval)

    def on_batches(self, trainer: Trainer, batches: list[Batch]) -> list[Batch]:
        self._batch = batches[0] if self._due(trainer) and batches else None
        return batches

    def veto(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> Action:
        if self._due(trainer):
            named = self._named(trainer)
            grads = {n: p.grad for n, p in named.items() if p.grad is not None}
            self._grad_norms = self._norms(trainer, grads)
            self._before = [p.detach().clone() for p in named.values()]
        return Action.STEP

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        grad_norms, before, batch = self._grad_norms, self._before, self._batch
        self._grad_norms = self._before = self._batch = None
        step = trainer.progress.step
        interval = trainer.run.cfg.metrics.detail_interval
        if result.action is not Action.STEP or not is_detail_step(step, interval) or before is None:
            return
        record: dict = {"step": step, "detail": True}
        record.update(self._weights(trainer, before, grad_norms))
        if batch is not None:
            record.update(self._forward(trainer, batch))
        trainer.log(record)

    # -- norms ---------------------------------------------------------------------------------------

    @staticmethod
    def _named(trainer: Trainer) -> dict[str, torch.Tensor]:
        """This rank's parameters by name, without a tied matrix's copy held apart (a pipeline's last stage:
        the embedding's rank counts the matrix once, as one process does)."""
        model = trainer.run.model
        copies = model.tied_copies()
        return {n: p for n, p in model.named_parameters() if n not in copies}

    @staticmethod
    def _keys(trainer: Trainer) -> list[str]:
        cfg = trainer.run.cfg
        # a reward model's head (score) and PPO's value head are matrices of their own whether or not the
        # embedding is tied
        own_head = cfg.train.objective == "reward" or (
            cfg.train.objective == "rl" and cfg.rl.algorithm == "ppo"
        )
        return part_keys(cfg.model.n_layers, cfg.model.tie_embeddings and not own_head)

    def _norms(self, trainer: Trainer, named: dict[str, torch.Tensor], whole: bool = False) -> torch.Tensor:
        """Per-part norms (``_keys`` order), then the norm of everything last when ``whole``."""
        groups = group_by_part(named, self._keys(trainer))
        if whole:
            groups["*"] = list(named.values())
        return part_norms(groups, trainer.run.device, self._across(trainer))

    @staticmethod
    def _across(trainer: Trainer):
        layout = trainer.run.layout
        return layout.group("pp") if layout.degrees["pp"] > 1 else None

    @torch.no_grad()
    def _weights(
        self, trainer: Trainer, before: list[torch.Tensor], grad_norms: torch.Tensor | None
    ) -> dict[str, float]:
        named = self._named(trainer)
        names = list(named)
        after = self._norms(trainer, named, whole=True)
        prior = self._norms(trainer, dict(zip(names, before, strict=True)), whole=True)
        for b, p in zip(before, named.values(), strict=True):  # in place: no second copy
            b.sub_(p.detach())  # theta_before - theta_after: the update's norm
        moved = self._norms(trainer, dict(zip(names, before, strict=True)), whole=True)
        keys = [*self._keys(trainer), "*"]
        after_l, prior_l, moved_l = after.tolist(), prior.tolist(), moved.tolist()
        out: dict[str, float] = {}
        for i, key in enumerate(keys):
            suffix = "" if key == "*" else f"/{key}"
            out[f"param_norm{suffix}"] = after_l[i]
            out[f"update_ratio{suffix}"] = update_ratio(moved_l[i], prior_l[i])
        if grad_norms is not None:
            for key, value in zip(keys[:-1], grad_norms.tolist(), strict=True):
                out[f"grad_norm/{key}"] = value
        return out

    # -- the measuring forward -----------------------------------------------------------------------

    @torch.no_grad()
    def _forward(self, trainer: Trainer, batch: Batch) -> dict[str, float]:
        """Activation RMS and attention entropy of one eager forward of ``batch`` (the training module's
        ``inspect_forward``); nothing where no process runs the whole network (pipeline, tensor
        parallelism)."""
        run = trainer.run
        model = run.model
        batch = batch.to(run.precision.device)
        first_docs = batch.doc_ids[:1] if batch.doc_ids is not None and model.cfg.doc_mask else None
        t = batch.inputs.shape[1]
        if first_docs is not None:
            allowed = document_causal_mask(first_docs)[0, 0]
        else:
            allowed = torch.ones(t, t, dtype=torch.bool, device=batch.inputs.device).tril()
        act: dict[int, torch.Tensor] = {}
        ent: dict[int, torch.Tensor] = {}
        handles = []
        for key, block in model.blocks.items():
            i = int(key)

            def keep_rms(module, args, output, i: int = i) -> None:
                act[i] = rms(output)

            def probe(q: torch.Tensor, k: torch.Tensor, i: int = i, attn=block.attn) -> None:
                ent[i] = attention_entropy(q[0], k[0], allowed, attn.scale).mean()

            handles.append(block.register_forward_hook(keep_rms))
            block.attn.probe = probe
        try:
            measured = run.module.inspect_forward(batch, run.precision)
        finally:
            for handle in handles:
                handle.remove()
            for block in model.blocks.values():
                block.attn.probe = None
        if not measured:
            return {}
        layers = sorted(act)
        values = torch.stack([act[i] for i in layers] + [ent[i] for i in layers]).tolist()
        n = len(layers)
        out = {f"act_rms/block.{i}": values[j] for j, i in enumerate(layers)}
        out.update({f"attn_entropy/layer.{i}": values[n + j] for j, i in enumerate(layers)})
        out["attn_entropy"] = sum(values[n:]) / n
        return out


KINDS = ("embedding", "attention", "mlp", "norm", "head")


def param_kind(name: str) -> str:
    """The kind of the parameter called ``name`` in the plain model (``model/transformer.py``)."""
    first, _, rest = name.partition(".")
    if first in ("embed", "pos_embed"):
        return "embedding"
    # score: a reward model's head (posttrain/reward.py); value_head: PPO's (posttrain/ppo.py)
    if first in ("lm_head", "score", "value_head"):
        return "head"
    if first == "norm":
        return "norm"
    if first == "blocks":
        part = rest.split(".")[1]
        if part == "attn":
            return "attention"
        if part == "mlp":
            return "mlp"
        if part in ("attn_norm", "mlp_norm"):
            return "norm"
    raise ValueError(f"parameter {name!r} belongs to no known part of the model")


def param_block(name: str) -> int | None:
    """The block index of parameter ``name`` (``blocks.<i>.``...), None outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def part_keys(n_layers: int, tied: bool) -> list[str]:
    """Every part of the whole model, in a fixed order: ``block.0`` .. ``block.<L-1>``, then the kinds (the
    head only when untied). Every process lists the same keys, whichever parameters it holds."""
    return [f"block.{i}" for i in range(n_layers)] + [k for k in KINDS if k != "head" or not tied]


def parts_of(name: str) -> list[str]:
    """The part keys parameter ``name`` counts in: its block (if any) and its kind."""
    block = param_block(name)
    return ([f"block.{block}"] if block is not None else []) + [param_kind(name)]


def group_by_part(named: dict[str, torch.Tensor], keys: list[str]) -> dict[str, list[torch.Tensor]]:
    """``{part: [tensors]}`` for every key in ``keys`` (empty lists for parts this process lacks)."""
    groups: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for name, t in named.items():
        for key in parts_of(name):
            groups[key].append(t)
    return groups


def part_norms(
    groups: dict[str, list[torch.Tensor]],
    device: torch.device,
    across: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm ``sqrt(sum_i t_i^2)`` of each group's tensors, stacked in the groups' order (FP32, on
    ``device``). Sharded tensors (DTensors) count their whole tensor (``optim/clip.py::total_norm``);
    ``across`` (the pipeline group) adds the squares of processes holding other parts: one all-reduce."""
    norms = torch.stack([total_norm(ts).to(device=device, dtype=torch.float32) for ts in groups.values()])
    if across is not None:
        squared = norms**2
        dist.all_reduce(squared, group=across)
        norms = squared.sqrt()
    return norms


def update_ratio(delta_norm: float, before_norm: float) -> float:
    """``||theta_after - theta_before|| / ||theta_before||`` from the two norms (0 for a zero ``theta``)."""
    return delta_norm / before_norm if before_norm > 0 else 0.0


def rms(x: torch.Tensor) -> torch.Tensor:
    """``sqrt(mean(x^2))`` over every element, in FP32."""
    return x.float().pow(2).mean().sqrt()


def attention_entropy(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor,
    scale: float | None = None,
    max_elements: int = 1 << 22,
) -> torch.Tensor:
    """Entropy (nats) of every attention row of one sequence: ``(H, T)``.

    ``q`` (H, T, D) and ``k`` (H_kv, T, D) after RoPE (with fewer kv heads each is repeated, as
    ``model/attention.py::attend`` does); ``allowed`` (T, T) bool: query ``i`` may see key ``j`` (the causal
    mask, intersected with the document mask). Row ``i`` of head ``h``: ``s_j = scale * q_i . k_j`` for
    allowed ``j`` (``scale`` None: ``1 / sqrt(D)``), ``p = softmax(s)``, ``H_i = -sum_j p_j log p_j``; a row
    that may see ``n`` keys scores between 0 and ``log n``. Computed in FP32 over chunks of at most
    ``max_elements`` scores, so memory stays bounded for long sequences.
    """
    h, t, d = q.shape
    if k.shape[0] != h:
        k = k.repeat_interleave(h // k.shape[0], dim=0)
    s = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty(h, t, dtype=torch.float32, device=q.device)
    rows = max(1, max_elements // t)  # query rows per chunk
    for head in range(h):
        kh = k[head].float().T
        for start in range(0, t, rows):
            scores = (q[head, start : start + rows].float() @ kh) * s
            mask = allowed[start : start + rows]
            logp = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[head, start : start + rows] = -(logp.exp() * logp).masked_fill(~mask, 0.0).sum(-1)
    return out
