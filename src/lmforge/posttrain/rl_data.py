"""Prompts of RL runs: records, their batches, the loader and the rollouts' rows.

A prompt record is ``{"prompt": "..."}`` (one JSON object a line, ``posttrain.train_files`` /
``val_files``). With ``rl.template = "chat"`` the prompt is a user turn of the chat template followed by
``<|assistant|>\\n`` and completions stop at ``<|end|>``; with ``"none"`` it is ``<|endoftext|>`` and the
prompt's text, and completions stop at ``<|endoftext|>``. A prompt that leaves no room for
``rl.max_new_tokens`` within ``data.seq_len + 1`` tokens is skipped and reported with its ``file:line``.

Order (:class:`PromptLoader`, as the other post-training loaders): global prompt number ``j`` lies in epoch
``e = j // n`` and is prompt ``perm_e[j % n]``, ``perm_e`` drawn from ``(seed, e)``; a micro-step consumes
``world * micro_batch_size`` prompt numbers, rank ``r`` the ``r``-th block. A batch carries the number of
its first prompt (``position``), from which its completions' sampling seed is drawn: a batch and its
rollouts are a pure function of (seed, position, rank, weights), and a resume is exact.

**Rollout cycles** (``rl.ppo_epochs = E``, ``rl.mini_batches = M``, ``A`` micro-batches a step): a
rollout batch is the prompts of ``M`` consecutive steps, drawn at once and then trained on for ``E M``
optimizer steps, one mini-batch (one step's prompts, in the order ``M`` plain steps would take them) a
step, the ``E`` passes in the same order. Step ``u`` of a cycle (``0 <= u < E M``) trains on mini-batch
``j = u mod M``; its micro-batch ``i`` holds the prompt numbers from ``c + ((j A + i) world + rank) k``
(``c`` the cycle's first prompt number, ``k`` the micro-batch size). At ``u = 0`` micro-batch ``i`` also
carries (``ahead``) micro-batch ``i`` of mini-batches ``1 .. M-1``: the objective samples them all from
the weights of the cycle's first step (``posttrain/rl.py``). With ``E = M = 1`` every step is a cycle of
one and the order is the plain one above. The place in the cycle is counted in ``next_batch`` calls
(``A`` a step: the config check refuses a batch schedule with cycles) and kept in
:meth:`PromptLoader.state_dict`, with ``E``, ``M``, ``A`` and the world, which a resume inside a cycle
must keep (the ranks' rollout buffers are theirs, ``train/checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lmforge.data.loader import Batch
from lmforge.errors import DataError
from lmforge.posttrain.records import BadRecord, Turn, _Bad, _json, _lines, _object, _string
from lmforge.posttrain.template import ChatTemplate


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str  # what the reward reads
    source: str


@dataclass
class PromptBatch(Batch):
    """``k`` prompts: ``inputs`` the prompt ids left-padded (for the protocol; rollouts are built from
    ``prompts``), their texts and the global number of the first (the sampling seed's). In a rollout cycle
    (module docstring): ``update``, the step's place in the cycle (0: the rollouts are drawn in this step);
    ``cycle``, the number of the cycle's first prompt; ``ahead``, at ``update = 0``, the batches of the
    later mini-batches to draw with this one (empty otherwise, and with ``rl.mini_batches = 1``)."""

    prompts: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    position: int = 0
    update: int = 0
    cycle: int = 0
    ahead: list[PromptBatch] = field(default_factory=list)

    @property
    def n_targets(self) -> int:
        """Prompts (groups), not tokens: the RL loss is a mean over the step's groups."""
        return len(self.prompts)

    def to(self, device: torch.device) -> PromptBatch:
        moved = Batch.to(self, device)
        return PromptBatch(
            moved.inputs, moved.targets, moved.doc_ids, self.prompts, self.texts, self.position,
            self.update, self.cycle, self.ahead,
        )  # fmt: skip


def prompt_ids(text: str, template: ChatTemplate, kind: str) -> list[int]:
    """The ids generation continues for ``text`` (``kind``: ``rl.template``)."""
    if kind == "chat":
        return template.prompt_ids([Turn("user", text)])
    return [template.tokenizer.eot_id, *template.tokenizer.encode(text)]


def stop_id(template: ChatTemplate, kind: str) -> int:
    return template.end_id if kind == "chat" else template.tokenizer.eot_id


def read_prompts(
    paths: Sequence[str], template: ChatTemplate, kind: str, limit: int, key: str
) -> tuple[list[Prompt], list[BadRecord]]:
    """The prompt records of ``paths`` in order and the unusable ones (``limit``: the most prompt tokens,
    ``data.seq_len + 1 - rl.max_new_tokens``)."""
    good, bad = [], []
    for path in paths:
        for source, raw in _lines(Path(path)):
            try:
                text = _string(_object(_json(raw)), "prompt")
            except _Bad as exc:
                bad.append(BadRecord(source, str(exc)))
                continue
            ids = prompt_ids(text, template, kind)
            if len(ids) > limit:
                bad.append(
                    BadRecord(
                        source,
                        f"prompt of {len(ids)} tokens leaves no room for rl.max_new_tokens within "
                        f"data.seq_len+1 (at most {limit}); raise data.seq_len or shorten the prompt",
                    )
                )
                continue
            good.append(Prompt(tuple(ids), text, source))
    return good, bad


def stack_prompts(
    prompts: Sequence[Prompt], position: int, pad_id: int, update: int = 0, cycle: int = 0
) -> PromptBatch:
    width = max(len(p.ids) for p in prompts)
    inputs = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        inputs[i, width - len(p.ids) :] = torch.tensor(p.ids)
    targets = torch.full_like(inputs, -100)
    return PromptBatch(
        inputs,
        targets,
        torch.zeros_like(inputs),
        [list(p.ids) for p in prompts],
        [p.text for p in prompts],
        position,
        update,
        cycle,
    )


class PromptLoader:
    """Shuffled prompt batches for training (``TrainLoader``) in rollout cycles of ``epochs`` x
    ``mini_batches`` steps of ``accum`` micro-batches (module docstring); resumable via ``state_dict``."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        micro_batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        pad_id: int = 0,
        accum: int = 1,
        epochs: int = 1,
        mini_batches: int = 1,
    ):
        if not prompts:
            raise DataError("posttrain.train_files: no usable prompts; check the records")
        self.prompts, self.mbs, self.seed = list(prompts), micro_batch_size, seed
        self.rank, self.world, self.pad_id = rank, world, pad_id
        # without cycles every call is a cycle of its own (a batch schedule may vary the calls a step)
        self.accum = accum if epochs * mini_batches > 1 else 1
        self.epochs, self.mini_batches = epochs, mini_batches
        self.n = len(self.prompts)
        self.position = 0  # the first prompt number of the current cycle
        self.calls = 0  # next_batch calls into the current cycle
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _prompt_of(self, j: int) -> int:
        epoch, i = divmod(j, self.n)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._perm_epoch = epoch
        return int(self._perm[i])

    @property
    def epoch(self) -> float:
        return self.position / self.n

    @property
    def cycle_calls(self) -> int:
        """``next_batch`` calls of one cycle: ``E M A``."""
        return self.epochs * self.mini_batches * self.accum

    def _micro(self, mini: int, micro: int, update: int) -> PromptBatch:
        first = self.position + ((mini * self.accum + micro) * self.world + self.rank) * self.mbs
        chosen = [self.prompts[self._prompt_of(j)] for j in range(first, first + self.mbs)]
        return stack_prompts(chosen, first, self.pad_id, update, self.position)

    def next_batch(self) -> PromptBatch:
        update, micro = divmod(self.calls, self.accum)
        batch = self._micro(update % self.mini_batches, micro, update)
        if update == 0:
            batch.ahead = [self._micro(j, micro, 0) for j in range(1, self.mini_batches)]
        self.calls += 1
        if self.calls == self.cycle_calls:
            self.position += self.mini_batches * self.accum * self.world * self.mbs
            self.calls = 0
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        while True:
            yield self.next_batch()

    def report(self) -> dict[str, float | int | str]:
        return {}

    def summary(self) -> dict:
        return {"train_prompts": self.n}

    def state_dict(self) -> dict:
        return {
            "kind": "prompts",
            "position": self.position,
            "calls": self.calls,
            "cycle": [self.epochs, self.mini_batches, self.accum],
            "seed": self.seed,
            "world": self.world,
            "n_prompts": self.n,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "prompts":
            raise DataError("train.objective: the checkpoint was not trained on RL prompts (lmforge rl)")
        if state["n_prompts"] != self.n:
            raise DataError(
                f"posttrain.train_files: the checkpoint was trained on {state['n_prompts']} prompts, these "
                f"files give {self.n}; resume with the same records"
            )
        calls = int(state.get("calls", 0))
        if calls:  # inside a rollout cycle: the ranks' buffers hold its rollouts, drawn for this shape
            saved = (*state["cycle"], state["world"])
            now = (self.epochs, self.mini_batches, self.accum, self.world)
            if tuple(saved) != now:
                raise DataError(
                    f"rl.ppo_epochs: the checkpoint stopped inside a rollout cycle of (ppo_epochs, "
                    f"mini_batches, micro-batches a step, data-parallel ranks) = {tuple(saved)}, this run has "
                    f"{now}; resume with the same rl.ppo_epochs, rl.mini_batches, train.tokens_per_step and "
                    "layout, or from a checkpoint at a step that is a multiple of ppo_epochs x mini_batches"
                )
        self.seed, self.position, self.calls = state["seed"], int(state["position"]), calls


def prompt_eval_batches(
    prompts: Sequence[Prompt], batch_size: int, pad_id: int, rank: int = 0, world: int = 1
) -> Iterator[PromptBatch]:
    """Every held-out prompt once, in order (rank ``r`` of ``world``: prompts ``r, r + world, ...``)."""
    mine = list(range(rank, len(prompts), world))
    for start in range(0, len(mine), batch_size):
        yield stack_prompts([prompts[i] for i in mine[start : start + batch_size]], start, pad_id)


def rollout_rows(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, doc_ids)`` of prompt + completion rows, right-padded to the longest (rounded up to
    a multiple of ``multiple``: tensor parallelism's sequence shards): targets are the completion tokens
    (``-100`` on the prompt and padding), the padding a document of its own."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    width = -(-(max(len(s) for s in seqs) - 1) // multiple) * multiple
    inputs = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    targets = torch.full_like(inputs, -100)
    docs = torch.ones_like(inputs)
    for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
        n = len(s) - 1
        inputs[i, :n] = torch.tensor(s[:-1])
        targets[i, len(p) - 1 : n] = torch.tensor(s[len(p) :])
        docs[i, :n] = 0
    return inputs, targets, docs
