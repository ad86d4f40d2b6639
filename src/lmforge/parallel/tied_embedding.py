"""Tied embeddings under pipeline parallelism: one matrix, used by the first stage (as the token
embedding) and by the last stage (as the output head).

With ``model.tie_embeddings`` one process holds one ``(vocab, d_model)`` matrix under two names
(``embed.weight``, ``lm_head.weight``); its gradient is the sum of what the embedding and the head
contribute. A pipeline puts the embedding on stage 0 and the head on the last stage, so (as Megatron-LM's
"embedding group" does):

* **Where the matrix lives.** When one rank runs both stages (``zbv``: rank 0 owns stage 0 and stage
  ``2 pp - 1``) and the matrix is a plain tensor, the two stage modules share one parameter
  (:func:`tie_stages`): autograd adds both uses' gradients into it as in one process, and nothing else is
  needed. Otherwise each of the two stages keeps its own copy: on two ranks (``gpipe``, ``1f1b``,
  ``interleaved_1f1b``, ``zero_bubble``: stage 0 on pipeline rank 0, the last stage on rank ``pp - 1``), or
  on one rank when the stages hold DTensors (FSDP2 or tensor parallelism wrap each stage apart, and a
  parameter cannot belong to two FSDP2 roots); the copies are then summed locally. That last case is
  unreachable today: ``zbv`` is refused with ``parallel.dp_shard`` or ``parallel.tp`` above 1
  (``train/build.py::check_model_layout``: its split backward trains other weights under FSDP2 and fails
  under TP in torch 2.13); it is unit-tested in one process (``tests/test_tied_embedding.py``).
* **Initialisation.** Both copies start with the values one process draws for the tied matrix from
  ``train.seed``: the whole model's initialisation plan names that matrix under both names
  (``model/init.py``), and ``parallel/materialize.py`` fills every parameter this rank holds under any
  name of a step, so a stage holding only ``lm_head.weight`` gets the embedding's draw. Nothing else is
  needed from the stage build.
* **Gradients.** After the step's last micro-batch's backward, and before anything reads the gradients
  (unscaling, the norm, clipping), :meth:`TiedEmbedding.reduce_grads` replaces every copy's gradient with
  the sum of all copies': the copies on this rank are added, then summed over the *embedding group* (for
  each data-parallel / tensor-parallel coordinate, the two pipeline ranks of stage 0 and of the last
  stage; with ``pp = 2`` that is the pipeline group itself). Sharded gradients (FSDP2, TP) reduce their
  local shards: both copies are ``Shard(0)`` of the same matrix over the same meshes, so the shards
  correspond. Both copies then take the same optimizer step from the same state and stay equal bit for
  bit.
* **Counted once.** A copy held apart is ``lm_head.weight`` on the last stage, listed by
  ``Transformer.tied_copies`` as a copy of ``embed.weight``: the gradient norm and the detail metrics
  leave it out (the embedding's rank counts the matrix), the optimizer puts it in the embedding's group
  (weight decay and learning rate of an embedding, as in one process), and checkpoints store its
  optimizer state under ``embed.weight`` (``train/checkpoint.py``), so every layout writes and reads the
  keys one process does.

Cost of copies held apart: one all-reduce of the matrix's gradient (``vocab x d_model`` values) between two
ranks per optimizer step, and on the last stage's rank the matrix, its gradient and its optimizer state
(which ``plan/memory.py::stage_tensors`` already counts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.model.transformer import Transformer


def embedding_group(group: dist.ProcessGroup, first: int, last: int) -> dist.ProcessGroup | None:
    """The process group of pipeline ranks ``first`` and ``last`` (ranks within ``group``, the pipeline
    group) on this rank's pipeline; None on the other pipeline ranks and when one rank owns both. With two
    pipeline ranks it is ``group``; else a new group of the two, created by those two ranks only
    (``use_local_synchronization``: the other pipelines' pairs create their own)."""
    me = dist.get_rank(group)
    if first == last or me not in (first, last):
        return None
    if dist.get_world_size(group) == 2:
        return group
    ranks = sorted(dist.get_global_rank(group, r) for r in (first, last))
    return dist.new_group(ranks, use_local_synchronization=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedEmbedding:
    """This rank's copies of the tied matrix held apart (``copies``: 0, 1 or 2 parameters; none when the
    stages share one parameter or this rank holds neither end) and the embedding ``group`` they are summed
    over (None: every copy is on this rank)."""

    def __init__(self, copies: list[nn.Parameter], group: dist.ProcessGroup | None = None):
        self.copies, self.group = copies, group

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """``g_copy <- sum of every copy's gradient`` for each copy (module docstring); a copy that got
        no gradient contributes zeros. Once per optimizer step, after the last backward."""
        if not self.copies:
            return
        for p in self.copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in self.copies]
        total = grads[0] if len(grads) == 1 else grads[0] + grads[1]  # the embedding's, then the head's
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            if g is not total:
                g.copy_(total)


def tie_stages(
    first: Transformer | None,
    last: Transformer | None,
    group: dist.ProcessGroup,
    first_rank: int,
    last_rank: int,
) -> TiedEmbedding:
    """Tie the embedding of stage 0 (``first``, None when another rank runs it) to the output head of the
    last stage (``last``, likewise), both materialised with the tied matrix's values; ``first_rank`` and
    ``last_rank``: the pipeline ranks (in ``group``) that run them. One rank with both plain tensors: the
    head takes the embedding's parameter. Else the copies and their embedding group (module docstring)."""
    if first is not None and last is not None:
        emb, head = first.embed.weight, last.lm_head.weight
        if not isinstance(emb, DTensor) and not isinstance(head, DTensor):
            last.lm_head.weight = emb
            return TiedEmbedding([])
        if emb.placements != head.placements or emb.to_local().shape != head.to_local().shape:
            shapes = [(t.placements, tuple(t.to_local().shape)) for t in (emb, head)]
            raise RuntimeError(f"tied embedding copies are sharded differently: {shapes[0]} vs {shapes[1]}")
    copies = [first.embed.weight] if first is not None else []
    copies += [last.lm_head.weight] if last is not None else []
    return TiedEmbedding(copies, embedding_group(group, first_rank, last_rank) if copies else None)
