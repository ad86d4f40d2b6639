"""Score documents with a trained lmforge run: the mean per-token loss (nats) and perplexity of each.

A document is scored as training stores it (``data/prepare.py``): ``<|endoftext|>`` followed by its
tokens, of which at most ``max_tokens`` are scored, so a sequence ``t_0 .. t_{n-1}`` with ``t_0`` the
end-of-text token and ``n - 1 = min(len(tokens), max_tokens)``. Its loss is the mean next-token
cross-entropy over every token after the first::

    loss = 1 / (n - 1) * sum_{j=1}^{n-1} -log p(t_j | t_{s(j)} .. t_{j-1})      perplexity = exp(loss)

where ``t_{s(j)} .. t_{j-1}`` is the left context the model reads for ``t_j``. A sequence that fits the
model's context (``n <= C + 1``, ``C = data.seq_len``) is one window, ``s(j) = 0``. A longer one is read
in windows of at most ``C + 1`` tokens (:func:`windows`): each window ends ``stride`` tokens after the
previous one and counts only the targets the earlier windows did not (its last ones), so every token
after the first is predicted exactly once, each with at least ``C + 1 - stride`` tokens of left context
(all of them where fewer precede it) and as much as its window gives.

Loading reuses ``lmforge eval`` / ``generate``'s path (:func:`lmforge.evaluate.run_loading.load_run`),
imported when the weights are first needed: ``lmforge data`` stays free of the training packages until
a model-based stage runs. Scoring runs on the CPU in FP32 under ``torch.inference_mode``; windows of
several documents are batched (right-padded: attention is causal, so padding after a window's tokens
changes none of them) and only the counted positions go through the output head.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.errors import ConfigError, UserError
from lmforge.recipe import load_saved_config

HEAD_ROWS = 4096  # positions sent through the output head at once (bounds the logits' memory)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows scoring a sequence of ``n`` tokens with a model of ``context`` positions.

    Each window is ``(start, end, first)``: the model reads tokens ``start .. end - 2`` and predicts
    ``start + 1 .. end - 1``; the predictions counted are those of targets ``first .. end - 1``. The
    first window is ``(0, min(n, C + 1), 1)``; each next one ends at ``e = min(prev_end + stride, n)``,
    starts at ``max(0, e - C - 1)`` and counts from ``prev_end``. Every target ``1 .. n - 1`` is counted
    once; empty for ``n < 2``.
    """
    if context < 1 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 1 and 1 <= stride <= context (got {context}, {stride})")
    if n < 2:
        return []
    end = min(n, context + 1)
    out = [(0, end, 1)]
    while end < n:
        new_end = min(end + stride, n)
        out.append((max(0, new_end - context - 1), new_end, end))
        end = new_end
    return out


def checkpoint_of(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint of ``step`` (None: the newest complete one) of ``run_dir``; a ConfigError starting
    ``run:`` (not a run, no complete checkpoint) or ``step:`` (no checkpoint of that step)."""
    from lmforge.evaluate.run_loading import pick_checkpoint

    try:
        return pick_checkpoint(Path(run_dir), step)
    except UserError as exc:
        field, _, reason = str(exc).partition(": ")
        raise ConfigError(f"{'step' if field == '--step' else 'run'}: {reason}") from None


class LMScorer:
    """Loss and perplexity of documents under a run's model (CPU, FP32).

    ``run_dir`` and ``step`` are checked when the scorer is made (one-line :class:`ConfigError`); the
    weights are loaded on the first call. ``batch_size`` windows go through the model at once;
    ``threads`` sets torch's intra-op threads of this process (None: leave them); ``stride`` is the
    window stride of long documents (None: half the model's context).
    """

    def __init__(
        self,
        run_dir: str | Path,
        step: int | None = None,
        max_tokens: int = 2048,
        batch_size: int = 8,
        threads: int | None = None,
        stride: int | None = None,
    ):
        for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size), ("threads", threads)):
            if value is not None and value < 1:
                raise ConfigError(f"{name}: give an integer >= 1 (got {value})")
        self.run_dir = Path(run_dir)
        self.checkpoint = checkpoint_of(self.run_dir, step)
        self.step = int(self.checkpoint.name.removeprefix("step_"))
        self.max_tokens, self.batch_size, self.threads = max_tokens, batch_size, threads
        self.context: int = load_saved_config(self.checkpoint / "config.toml").data.seq_len
        """The model's context: the run's ``data.seq_len``."""
        self.stride = stride if stride is not None else max(1, self.context // 2)
        if not 1 <= self.stride <= self.context:
            raise ConfigError(f"stride: give 1 .. {self.context} (the run's data.seq_len), got {stride}")
        self._loaded: tuple[Any, Any] | None = None  # tokenizer, model

    def __getstate__(self) -> dict[str, Any]:  # the model is loaded again where the scorer is used
        return {**self.__dict__, "_loaded": None}

    def _load(self) -> tuple[Any, Any]:
        """(tokenizer, model) of the checkpoint, loaded once (``lmforge eval``'s loader)."""
        if self._loaded is None:
            import torch

            from lmforge.evaluate.run_loading import load_run

            if self.threads is not None:
                torch.set_num_threads(self.threads)
            _, tok, model, _ = load_run(self.run_dir, torch.device("cpu"), self.step)
            self._loaded = (tok, model.float().eval())
        return self._loaded

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as scored: end-of-text, then at most ``max_tokens`` of its tokens."""
        tok, _ = self._load()
        return [[tok.eot_id, *ids[: self.max_tokens]] for ids in tok.encode_batch(list(texts))]

    def losses(self, texts: Sequence[str]) -> np.ndarray:
        """Mean next-token cross-entropy (nats) of each text (float64); NaN for a text without tokens."""
        import torch

        _, model = self._load()
        seqs = self.token_ids(texts)
        jobs = [(i, w) for i, s in enumerate(seqs) for w in windows(len(s), self.context, self.stride)]
        jobs.sort(key=lambda job: job[1][0] - job[1][1])  # longest first: little padding per batch
        sums = np.zeros(len(seqs), dtype=np.float64)
        with torch.inference_mode():
            for b in range(0, len(jobs), self.batch_size):
                batch = jobs[b : b + self.batch_size]
                width = max(end - start for _, (start, end, _) in batch) - 1
                x = torch.zeros(len(batch), width, dtype=torch.long)
                y = torch.full((len(batch), width), -100, dtype=torch.long)
                owner = torch.empty(len(batch), width, dtype=torch.long)
                for r, (i, (start, end, first)) in enumerate(batch):
                    w = torch.tensor(seqs[i][start:end], dtype=torch.long)
                    x[r, : end - start - 1] = w[:-1]
                    y[r, first - start - 1 : end - start - 1] = w[first - start :]
                    owner[r] = i
                keep = y != -100
                hidden = model(x)[keep]
                targets, docs = y[keep], owner[keep]
                for h, t, d in zip(
                    hidden.split(HEAD_ROWS), targets.split(HEAD_ROWS), docs.split(HEAD_ROWS), strict=True
                ):
                    nll = torch.nn.functional.cross_entropy(model.logits(h).float(), t, reduction="none")
                    np.add.at(sums, d.numpy(), nll.double().numpy())
        counts = np.array([len(s) - 1 for s in seqs], dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """Perplexity of each text: ``exp(loss)`` (float64); NaN for a text without tokens."""
        return np.exp(self.losses(texts))
