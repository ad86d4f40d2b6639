"""The end-of-run sample: ``train.sample_tokens`` tokens after ``train.sample_prompt``."""

from __future__ import annotations

from lmforge.data.tokenizer import Tokenizer
from lmforge.model.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.train.callbacks.base import Callback
from lmforge.train.trainer import Trainer


def sample_text(model: Transformer, tok: Tokenizer, prompt: str, n: int, seed: int) -> str:
    """``prompt`` and up to ``n`` sampled tokens (stopping at end-of-text)."""
    ids = generate(model, [tok.eot_id, *tok.encode(prompt)], n, stop_token=tok.eot_id, seed=seed)
    return prompt + tok.decode(ids)


class Sample(Callback):
    def on_train_end(self, trainer: Trainer) -> None:
        t = trainer.run.cfg.train
        if t.sample_tokens:
            tok = trainer.run.data.tokenizer
            trainer.summary["sample"] = sample_text(
                trainer.run.model, tok, t.sample_prompt, t.sample_tokens, t.seed
            )
