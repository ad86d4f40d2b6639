"""The end-of-run sample: ``train.sample_tokens`` tokens after the sample prompt."""

from __future__ import annotations

import logging

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.data.preflight import default_sample_prompt
from lmforge.data.tokenizer import Tokenizer
from lmforge.model.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.posttrain.run import chat_sample
from lmforge.train.build import Run, build_model
from lmforge.train.callbacks import Callback
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def sample_text(model: Transformer, tok: Tokenizer, prompt: str, n: int, seed: int) -> str:
    """``prompt`` and up to ``n`` sampled tokens (stopping at end-of-text)."""
    ids = generate(model, [tok.eot_id, *tok.encode(prompt)], n, stop_token=tok.eot_id, seed=seed)
    return prompt + tok.decode(ids)


def whole_model(run: Run) -> Transformer | None:
    """The trained model, whole, in this process: the run's own model for one process; under data or
    tensor parallelism an unsharded copy gathered on rank 0 (every rank takes part; None on the others)."""
    if not run.layout.distributed:
        return run.model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(run.model, options=options)
    if not run.layout.is_main:
        return None
    model = build_model(run.cfg, run.data.tokenizer.vocab_size, torch.device("cpu"), init=False)
    model.load_state_dict(state)
    return model


class Sample(Callback):
    """``train.sample_prompt``, or when unset the first words of the first validation document
    (``data/preflight.py``), continued by the trained model into ``trainer.summary["sample"]``. Under
    pipeline parallelism no rank holds the whole model: ``lmforge generate RUN`` samples from the final
    checkpoint instead."""

    def on_train_end(self, trainer: Trainer) -> None:
        t, data = trainer.run.cfg.train, trainer.run.data
        if t.sample_tokens and trainer.run.layout.degrees["pp"] > 1:
            log.info("sample: not taken under pipeline parallelism; run lmforge generate on the run folder")
            return
        if t.sample_tokens:
            model = whole_model(trainer.run)
            if model is None:
                return
            if t.objective != "lm":
                trainer.summary["sample"] = chat_sample(
                    model, trainer.run.data, t.sample_prompt, t.sample_tokens, t.seed
                )
                return
            prompt = (
                t.sample_prompt
                if t.sample_prompt is not None
                else default_sample_prompt(data.val, data.tokenizer)
            )
            trainer.summary["sample"] = sample_text(model, data.tokenizer, prompt, t.sample_tokens, t.seed)
