"""The end-of-run sample: ``train.sample_tokens`` tokens after the sample prompt."""

from __future__ import annotations

from lmforge.data.tokenizer import Tokenizer
from lmforge.model.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.train.callbacks.base import Callback
from lmforge.train.preflight import default_sample_prompt
from lmforge.train.trainer import Trainer


def sample_text(model: Transformer, tok: Tokenizer, prompt: str, n: int, seed: int) -> str:
    """``prompt`` and up to ``n`` sampled tokens (stopping at end-of-text)."""
    ids = generate(model, [tok.eot_id, *tok.encode(prompt)], n, stop_token=tok.eot_id, seed=seed)
    return prompt + tok.decode(ids)


class Sample(Callback):
    """``train.sample_prompt``, or when unset the first words of the first validation document
    (``train/preflight.py``), continued by the trained model into ``trainer.summary["sample"]``."""

    def on_train_end(self, trainer: Trainer) -> None:
        t, data = trainer.run.cfg.train, trainer.run.data
        if t.sample_tokens:
            prompt = (
                t.sample_prompt
                if t.sample_prompt is not None
                else default_sample_prompt(data.val, data.tokenizer)
            )
            trainer.summary["sample"] = sample_text(
                trainer.run.model, data.tokenizer, prompt, t.sample_tokens, t.seed
            )
