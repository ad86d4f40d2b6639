"""The end-of-run sample: ``train.sample_tokens`` tokens after the sample prompt."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from lmforge.data.preflight import default_sample_prompt
from lmforge.model.sampling import generate
from lmforge.model.transformer import Transformer
from lmforge.parallel.layout import Layout
from lmforge.posttrain.run import chat_sample
from lmforge.tokenizer import Tokenizer
from lmforge.train.build import Run, build_model
from lmforge.train.callbacks import Callback
from lmforge.train.trainer import Trainer

log = logging.getLogger(__name__)


def sample_text(model: Transformer, tok: Tokenizer, prompt: str, n: int, seed: int) -> str:
    """``prompt`` and up to ``n`` sampled tokens (stopping at end-of-text)."""
    ids = generate(model, [tok.eot_id, *tok.encode(prompt)], n, stop_token=tok.eot_id, seed=seed)
    return prompt + tok.decode(ids)


def whole_model(run: Run) -> Transformer | None:
    """The trained model, whole, in this process: the run's own model for one process; under several
    processes an unsharded copy on rank 0's CPU (None on the other ranks). Every rank takes part.

    Data or tensor parallelism: ``get_model_state_dict`` gathers every sharded parameter onto rank 0's
    CPU. A pipeline: each stage's ranks first gather their stages' parameters in full (on every rank of
    the stage, since the offloading gather keeps them on global rank 0 alone), then the ranks of rank 0's
    pipeline group (one per stage) send theirs to rank 0 (:func:`pipeline_state`). The copy has the run's
    parameter dtype (float64 under ``train.precision = "fp64"``, else float32)."""
    if not run.layout.distributed:
        return run.model
    pipeline = run.layout.degrees["pp"] > 1
    options = StateDictOptions(full_state_dict=True, cpu_offload=not pipeline)
    state = get_model_state_dict(run.model, options=options)
    if pipeline:
        state = pipeline_state(state, run.layout)
    if not run.layout.is_main:
        return None
    model = build_model(run.cfg, run.data.tokenizer.vocab_size, torch.device("cpu"), init=False)
    if next(run.model.parameters()).dtype == torch.float64:
        model.to(torch.float64)
    model.load_state_dict(state)
    return model


def pipeline_state(state: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The whole model's parameters on rank 0 from ``state``, each rank's full stages: the ranks of rank
    0's pipeline group (coordinate 0 in every other mesh dimension) send theirs to rank 0 over that group;
    their union is the whole model (a tied head's copy on the last stage comes as ``lm_head.weight``, the
    same values as ``embed.weight``). Empty on every rank but 0."""
    if any(layout.mesh.get_coordinate()[1:]):  # (pp, dp_replicate, dp_shard, tp): not rank 0's pipeline
        return {}
    local = {name: t.detach().to("cpu") for name, t in state.items()}
    parts: list[dict] | None = [{} for _ in range(layout.degrees["pp"])] if layout.is_main else None
    dist.gather_object(local, parts, dst=0, group=layout.group("pp"))
    return {name: t for part in parts or [] for name, t in part.items()}


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
            if trainer.run.val is None:  # post-training: a chat turn, not a continued text
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
