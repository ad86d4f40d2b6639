"""Warnings before training starts: one line each, for settings that run but will not give what the user
expects. Each check is a pure function returning the warning text or None; :func:`preflight` runs them on a
built run and logs what they find.
"""

from __future__ import annotations

import logging

from lmforge.config import Config
from lmforge.data.prepare import PreparedData
from lmforge.data.shards import Shard
from lmforge.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MIN_VAL_DOCS = 16
MIN_VAL_TOKENS = 16_384
MAX_EPOCHS = 4.0
PROMPT_SAMPLE_TOKENS = 262_144  # training tokens decoded to look for the sample prompt
DEFAULT_PROMPT_TOKENS = 8  # tokens of the first validation document used as the default sample prompt


def check_validation(docs: int, tokens: int) -> str | None:
    """A validation split under :data:`MIN_VAL_DOCS` documents or :data:`MIN_VAL_TOKENS` tokens."""
    if docs >= MIN_VAL_DOCS and tokens >= MIN_VAL_TOKENS:
        return None
    return (
        f"data.val_fraction: the validation split holds {docs:,} documents and {tokens:,} tokens (fewer than "
        f"{MIN_VAL_DOCS} or {MIN_VAL_TOKENS:,}); its loss will be noisy: raise data.val_fraction or add data"
    )


def epochs(steps: int, tokens_per_step: int, train_tokens: int) -> float:
    """Passes over the training data: ``steps * tokens_per_step / train_tokens``."""
    return steps * tokens_per_step / max(train_tokens, 1)


def check_epochs(steps: int, tokens_per_step: int, train_tokens: int) -> str | None:
    """A run that reads its training data more than :data:`MAX_EPOCHS` times."""
    n = epochs(steps, tokens_per_step, train_tokens)
    if n <= MAX_EPOCHS:
        return None
    return (
        f"train.steps: {steps:,} steps of {tokens_per_step:,} tokens read the {train_tokens:,} training "
        f"tokens {n:.1f} times; expect overfitting: add data or lower train.steps"
    )


def check_vocab(asked: int, got: int) -> str | None:
    """A trained tokenizer that came out smaller than ``data.vocab_size`` asked."""
    if got >= asked:
        return None
    return (
        f"data.vocab_size: asked for {asked:,} entries, the tokenizer trained on this corpus has {got:,} "
        f"(too few distinct merges); set data.vocab_size = {got} to make the config say what runs"
    )


def check_sample_prompt(prompt: str, corpus_text: str) -> str | None:
    """A ``train.sample_prompt`` that never occurs in a sample of the training text."""
    if not prompt.strip() or prompt in corpus_text:
        return None
    return (
        f"train.sample_prompt: {prompt!r} does not occur in the first {PROMPT_SAMPLE_TOKENS:,} training "
        "tokens; the end-of-run sample will say little (leave it unset to start from a validation document)"
    )


def default_sample_prompt(val: list[Shard], tok: Tokenizer) -> str:
    """The first words of the first validation document: its first :data:`DEFAULT_PROMPT_TOKENS` tokens,
    cut to the first line and back to the end of its last whole word when there is one (no trailing
    space: a byte-level BPE joins a word with the space before it)."""
    for shard in val:
        if len(shard.offsets) > 1:
            start, end = int(shard.offsets[0]), int(shard.offsets[1])
            ids = [int(t) for t in shard.tokens[start:end] if int(t) != tok.eot_id][:DEFAULT_PROMPT_TOKENS]
            text = tok.decode(ids).split("\n", 1)[0].rstrip()
            cut = text.rfind(" ")  # drop a word the 8 tokens may have cut, and the space before it
            return text[:cut] if cut > 0 else text
    return ""


def _sample_text(data: PreparedData) -> str:
    """Decoded text of up to :data:`PROMPT_SAMPLE_TOKENS` training tokens, taken evenly from the shards."""
    per = PROMPT_SAMPLE_TOKENS // max(len(data.train), 1)
    return "".join(data.tokenizer.decode(s.tokens[:per].tolist()) for s in data.train)


def preflight(cfg: Config, data: PreparedData, tokens_per_step: int) -> list[str]:
    """Every warning for a run of ``cfg`` on ``data``; each is logged and returned."""
    val_docs = sum(len(s.offsets) - 1 for s in data.val)
    val_tokens = sum(len(s.tokens) for s in data.val)
    train_tokens = sum(len(s.tokens) for s in data.train)
    found = [
        check_validation(val_docs, val_tokens),
        check_epochs(cfg.train.steps, tokens_per_step, train_tokens),
    ]
    if cfg.data.prepared is None and cfg.data.tokenizer is None:  # lmforge trained the tokenizer
        found.append(check_vocab(cfg.data.vocab_size, data.tokenizer.vocab_size))
    if cfg.train.sample_prompt is not None and cfg.train.sample_tokens:
        found.append(check_sample_prompt(cfg.train.sample_prompt, _sample_text(data)))
    warnings = [w for w in found if w is not None]
    for w in warnings:
        log.warning("%s", w)
    return warnings
