"""``lmforge sft`` / ``dpo`` / ``reward [RECIPE] --from RUN --run-dir OUT``: a post-training run that
starts from another run's checkpoint.

Starting it (one process, before any training):

1. the keys: lmforge's defaults, then the command's ``config.POSTTRAIN_DEFAULTS`` (a short fine-tuning
   rather than a pretraining), then the recipe, then ``--SECTION.KEY=VALUE`` flags; ``model.*`` and ``data.seq_len``
   come from the starting run (a flag for them is refused), ``train.objective`` is the command;
2. the tokenizer: the starting run's, with the chat template's special tokens added, written to
   ``OUT/tokenizer.json`` with ``OUT/chat_template.json``;
3. the weights: the starting checkpoint's, the embedding (and an untied head) grown to the new vocabulary
   with mean rows (``posttrain/vocab.py``);
4. DPO: the reference, either the starting model's log-probabilities of every training and held-out pair
   (``dpo.reference = "cached"``: ``OUT/reference_logps.npz``, computed once here) or its weights
   (``"model"``: ``OUT/reference_model.pt``, a frozen copy that scores each batch); a reward model: the
   language-model head dropped, the scalar head initialised from ``train.seed`` (``posttrain/reward.py``);
5. the state of a run about to take its first step, saved as checkpoint ``step_00000000`` (fresh
   optimizer, schedule at 0, loader at its start), as ``lmforge import`` does.

Then it trains exactly as ``lmforge train --resume --run-dir OUT`` would: every layout (``torchrun``),
precision, schedule, clipping, guard and callback applies, and a stopped run resumes with either command.
Under ``torchrun``, start with ``--prepare-only`` in one process (the ``parallel.*`` keys are kept in the
run's config; step 0 is written by that one process in a layout-free checkpoint), then launch
``torchrun ... -m lmforge sft --resume --run-dir OUT``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.config import POSTTRAIN_DEFAULTS, Config, ParallelConfig
from lmforge.errors import UserError
from lmforge.evaluate.run_loading import pick_checkpoint
from lmforge.model.lora import is_adapter_key
from lmforge.posttrain.template import SPECIAL_TOKENS, add_chat_tokens, write_template_file
from lmforge.posttrain.vocab import grow_vocab
from lmforge.recipe import load_config, load_saved_config
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from lmforge.train.resume import config_text, resume_config

log = logging.getLogger(__name__)

FROM_RUN = (
    "data.seq_len", "data.tokenizer", "data.vocab_size", "data.prepared", "data.sources", "train.objective"
)  # fmt: skip


def posttrain_config(
    kind: str, source: Config, run_dir: Path, recipe: str | None, overrides: dict[str, Any], vocab: int
) -> Config:
    """The run's config: defaults <- ``POSTTRAIN_DEFAULTS[kind]`` <- recipe <- flags, with the model, the context
    length, the tokenizer and ``data.sources`` (not read by post-training; recorded as what the model was
    trained on) of the starting run (``source``) and ``train.objective = kind``."""
    for key in overrides:
        if key.startswith("model.") or key in FROM_RUN:
            raise UserError(f"--{key}: comes from the --from run (its model and tokenizer); drop the flag")
    fixed = {
        **{f"model.{k}": v for k, v in source.model.model_dump(exclude_none=True).items()},
        "data.seq_len": source.data.seq_len,
        "data.sources": [s.model_dump() for s in source.data.sources],  # recorded: what the model read
        "data.tokenizer": str((run_dir / "tokenizer.json").resolve()),
        "data.vocab_size": vocab,
        "train.objective": kind,
    }
    cfg = load_config(recipe, {**overrides, **fixed}, defaults=POSTTRAIN_DEFAULTS[kind])
    if not cfg.posttrain.train_files:
        raise UserError(
            "posttrain.train_files: no records to train on; give --posttrain.train_files='[\"FILE.jsonl\"]' "
            "or a recipe with [posttrain] train_files"
        )
    return cfg


def start(
    kind: str,
    from_run: str | Path,
    run_dir: str | Path,
    recipe: str | None = None,
    overrides: dict[str, Any] | None = None,
    step: int | None = None,
) -> tuple[Config, Path]:
    """Make ``run_dir`` a post-training run (``kind``: ``"sft"``, ``"dpo"`` or ``"reward"``) of ``from_run``'s checkpoint
    (``step``: default the newest); returns its config and checkpoint ``step_00000000``."""
    from lmforge.posttrain.run import read_posttrain, write_reference
    from lmforge.train.build import build_run, validate  # the run's machinery: only once inputs are checked
    from lmforge.train.callbacks.checkpointing import config_state
    from lmforge.train.launch import default_callbacks
    from lmforge.train.trainer import Trainer

    from_run, run_dir = Path(from_run), Path(run_dir)
    if not (from_run / "config.toml").is_file():
        raise UserError(
            f"--from: {from_run} is not an lmforge run folder (no config.toml); give a run folder"
        )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(
            f"--from: start the run in one process first (lmforge {kind} --from RUN --run-dir OUT "
            f"--prepare-only), then launch torchrun ... lmforge {kind} --run-dir OUT --resume"
        )
    if latest_checkpoint(run_dir) is not None:
        raise UserError(
            f"--run-dir: {run_dir} already holds checkpoints; pass --resume to continue it or choose a new "
            "--run-dir"
        )
    ckpt = pick_checkpoint(from_run, step)
    source = load_saved_config(ckpt / "config.toml")
    with tempfile.TemporaryDirectory() as tmp:  # the run folder is written once the config and records hold
        tok = add_chat_tokens(from_run / "tokenizer.json", Path(tmp) / "tokenizer.json")
        cfg = posttrain_config(kind, source, run_dir, recipe, overrides or {}, tok.vocab_size)
        here = cfg.model_copy(update={"parallel": ParallelConfig()})  # step 0 is written by one process
        data = here.data.model_copy(update={"tokenizer": str(tok.path)})
        validate(here.model_copy(update={"data": data}))  # with the tokenizer the run will have (rl.reward)
        read_posttrain(here.model_copy(update={"data": data}))  # bad records stop it before any write
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tok.path, run_dir / "tokenizer.json")
    write_template_file(run_dir)
    state = grow_vocab(load_checkpoint(ckpt)["model"], tok.vocab_size)
    run = build_run(here, run_dir=run_dir)
    if kind == "reward":
        from lmforge.posttrain.reward import start_state

        state = start_state(state, run.model)
    if kind == "rl" and cfg.rl.algorithm == "ppo":  # the value head: its own initial values
        from lmforge.posttrain.ppo import with_value_head

        state = with_value_head(state, run.model)
    with torch.no_grad():  # a LoRA run keeps its adapters' initial values (model/lora.py: B = 0)
        missing, unexpected = run.model.load_state_dict(
            {k: v.to(run.device) for k, v in state.items()}, False
        )
    if unexpected or any(not is_adapter_key(k) for k in missing):
        raise RuntimeError(f"--from: the checkpoint does not fit the model: {missing[:3]} {unexpected[:3]}")
    if kind in ("dpo", "rl"):
        write_reference(run, run_dir)
    added = ", ".join(SPECIAL_TOKENS)
    toml = config_text(cfg, [f"# step 0: lmforge {kind} from {ckpt.resolve()} (tokens added: {added})"])
    (run_dir / "config.toml").write_text(toml)
    trainer = Trainer(run, default_callbacks(cfg, run_dir, False, toml))
    saved = trainer.state_dict()
    saved["config"] = config_state(cfg)
    return cfg, save_checkpoint(run_dir, 0, saved, toml, cfg.train.keep_checkpoints).final


def open_run(
    kind: str,
    from_run: str | None,
    run_dir: str | None,
    recipe: str | None,
    overrides: dict[str, Any],
    step: int | None = None,
    resume: bool = False,
) -> tuple[Config, Path, Path | None]:
    """``lmforge sft`` / ``dpo``: ``(config, run folder, checkpoint started from)`` of a new run of ``kind``
    started from ``from_run`` (:func:`start`; default folder ``runs/<kind>-<timestamp>``), or, with
    ``resume``, of the run in ``run_dir`` to continue (started-from checkpoint None)."""
    if resume:
        if not run_dir:
            raise UserError(f"--run-dir: --resume needs the folder of the {kind} run to continue")
        if from_run:
            raise UserError(
                "--from: a resumed run keeps its start; drop --from (or drop --resume for a new run)"
            )
        folder = Path(run_dir)
        cfg = resume_config(folder, recipe, overrides)
        if cfg.train.objective != kind:
            raise UserError(
                f"--run-dir: {folder} is a train.objective = {cfg.train.objective} run; continue it with "
                f"lmforge {'train' if cfg.train.objective == 'lm' else cfg.train.objective} --resume"
            )
        return cfg, folder, None
    if not from_run:
        raise UserError(f"--from: give the run to start from (lmforge {kind} --from runs/NAME)")
    folder = Path(run_dir) if run_dir else Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    from lmforge.train.launch import refuse_inside_a_run  # with the run's machinery, as start() does

    refuse_inside_a_run(folder)
    cfg, _ = start(kind, from_run, folder, recipe, overrides, step)
    return cfg, folder, pick_checkpoint(Path(from_run), step)  # the one start() read, not its step 0
