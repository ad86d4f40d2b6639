"""Open a finished or running run folder: its config, tokenizer and newest checkpoint's model (``lmforge
eval``, ``generate``, ``export``, a corpus ``perplexity`` stage); score it as training scores it (the
validation split, or a post-training run's held-out records)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from lmforge.config import Config
from lmforge.data.loader import TokenStream
from lmforge.data.prepare import prepare_data
from lmforge.errors import DataError, UserError
from lmforge.evaluate.quantized import is_quantized_export, load_quantized
from lmforge.evaluate.validation import evaluate, perplexity
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.parallel.data_parallel import GradientSync
from lmforge.posttrain.dpo import SequenceLogps
from lmforge.posttrain.objective_dpo import DPOModule
from lmforge.posttrain.objective_reward import RewardModule
from lmforge.posttrain.objective_rl import RLModule
from lmforge.posttrain.reward import RewardObjective, RewardScores
from lmforge.posttrain.rl import TokenLogps
from lmforge.posttrain.run import (
    REFERENCE_LOGPS,
    dpo_objective,
    load_reference,
    posttrain_validation,
    prepare_posttrain,
    rl_objective,
)
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_saved_config
from lmforge.tokenizer import Tokenizer
from lmforge.train.build import build_model
from lmforge.train.checkpoint import list_checkpoints, load_checkpoint
from lmforge.train.modules import LanguageModelModule


def load_run(
    run_dir: str | Path, device: torch.device, step: int | None = None
) -> tuple[Config, Tokenizer, Transformer, int]:
    """(config, tokenizer, model with the weights of checkpoint ``step`` (None: the newest), step) of
    ``run_dir``. An ``export --quantize`` folder loads as its quantized model (``evaluate/quantized.py``)."""
    run_dir = Path(run_dir)
    if is_quantized_export(run_dir):
        return load_quantized(run_dir, device)
    ckpt = pick_checkpoint(run_dir, step)
    cfg = load_saved_config(ckpt / "config.toml")
    tok = Tokenizer(run_dir / "tokenizer.json")
    state = load_checkpoint(ckpt)
    model = build_model(cfg, tok.vocab_size, device, init=False)
    model.load_state_dict(state["model"])
    return cfg, tok, model, int(state["progress"]["step"])


def pick_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint of ``step`` (None: the newest) of the run folder ``run_dir``; user errors for a
    folder that is no run, a run without a complete checkpoint and a step it has none of."""
    if not (run_dir / "config.toml").is_file():
        raise UserError(
            f"RUN: {run_dir} is not an lmforge run folder (no config.toml); give a folder under runs/"
        )
    found = list_checkpoints(run_dir)
    if not found:
        raise UserError(f"RUN: {run_dir} has no complete checkpoint yet; train longer or pick another run")
    if step is None:
        return found[-1]
    by_step = {int(p.name.removeprefix("step_")): p for p in found}
    if step not in by_step:
        have = ", ".join(str(s) for s in sorted(by_step))
        raise UserError(f"--step: {run_dir} has no checkpoint of step {step}; it has step(s) {have}")
    return by_step[step]


def evaluate_run(run_dir: str | Path, device: torch.device, tokens: int = 0) -> dict:
    """Validation loss and perplexity of the newest checkpoint of ``run_dir`` over ``tokens`` validation
    tokens (0: the run's ``train.eval_tokens``), in the run's precision, as training evaluates."""
    cfg, _, model, step = load_run(run_dir, device)
    precision = PrecisionPolicy.resolve(cfg.train.precision, device)
    if cfg.train.objective != "lm":  # post-training: the held-out records
        out = evaluate_posttrain(cfg, model, Path(run_dir), precision)
        if cfg.train.objective == "rl":  # val_loss is minus the reward: no likelihood
            return {"step": step, **out}
        return {"step": step, **out, "val_ppl": perplexity(out["val_loss"])}
    data = prepare_data(cfg.data)
    loss = evaluate(
        NextTokenLoss(model, cfg.train.loss_chunk),
        TokenStream(data.val),
        cfg.data.seq_len,
        cfg.train.micro_batch_size,
        tokens or cfg.train.eval_tokens,
        precision,
    )
    return {"step": step, "val_loss": loss, "val_ppl": perplexity(loss)}


def evaluate_posttrain(
    cfg: Config, model: torch.nn.Module, run_dir: Path, precision: PrecisionPolicy
) -> dict:
    """``lmforge eval`` of a post-training run: its held-out records scored as training scores them."""
    data = prepare_posttrain(cfg, None)
    if cfg.train.objective == "sft":
        scorer = NextTokenLoss(model, cfg.train.loss_chunk)
        module = LanguageModelModule(model, scorer, scorer, GradientSync())
    elif cfg.train.objective == "rl":  # greedy completions of the held-out prompts, rewarded
        policy = TokenLogps(model, cfg.train.loss_chunk)
        objective = rl_objective(cfg, policy, model, lambda: copy.deepcopy(model), run_dir)
        module = RLModule(model, objective, GradientSync())
    elif cfg.train.objective == "reward":
        objective = RewardObjective(RewardScores(model, data.tokenizer.eot_id))
        module = RewardModule(model, objective, GradientSync())
    else:
        load_reference(cfg, data, run_dir)
        if cfg.dpo.reference == "cached" and data.val_reference is None:
            raise DataError(f"--run: {run_dir / REFERENCE_LOGPS} is missing; the DPO run cannot be scored")
        objective = dpo_objective(
            cfg, SequenceLogps(model, cfg.train.loss_chunk), lambda: copy.deepcopy(model), run_dir
        )
        module = DPOModule(model, objective, GradientSync())
    loss, extra = posttrain_validation(cfg, data, module, precision)
    if loss is None:
        raise DataError("posttrain.val_files: the run has no held-out records to score; give --data FILES")
    return {"val_loss": loss, **extra}
