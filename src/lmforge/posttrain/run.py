"""What the one build path adds for ``train.objective = "sft"``, ``"dpo"``, ``"reward"`` and ``"rl"``: the records of
``[posttrain]`` read and tokenized with the run's chat template (bad ones counted and reported with
file:line), the loader, the objective, the held-out evaluation and the DPO / RL reference.

``posttrain/`` holds the pieces (records, template, loaders, losses); this module reads the config and the
run folder and puts them together. :class:`PostTraining` holds the data hooks every post-training
objective shares (``posttrain/objective_*.py``, registered for the build, ``train/modules.py::Objective``).
It imports nothing of ``train/``: the objectives call it (and ``lmforge eval`` of such a run,
``evaluate/run_loading.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lmforge.config import Config
from lmforge.errors import ConfigError, DataError
from lmforge.model.lora import dense_base
from lmforge.parallel.layout import Layout
from lmforge.posttrain.dpo import DPOObjective, SequenceLogps, check_dpo
from lmforge.posttrain.dpo_data import PairLoader, pair_eval_batches, reference_logps, tokenize_pairs
from lmforge.posttrain.ppo import PPOObjective
from lmforge.posttrain.records import BadRecord, Turn, read_examples, read_pairs
from lmforge.posttrain.reward import RewardPairLoader, reward_eval_batches, reward_pairs
from lmforge.posttrain.reward_pool import check_reward, open_reward
from lmforge.posttrain.rl import RLObjective, TokenLogps
from lmforge.posttrain.rl_data import PromptLoader, prompt_eval_batches, read_prompts, stop_id
from lmforge.posttrain.sft_data import SFTLoader, sft_eval_batches, tokenize_examples
from lmforge.posttrain.template import ChatTemplate
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REFERENCE_LOGPS = "reference_logps.npz"  # dpo.reference = "cached"
REFERENCE_MODEL = "reference_model.pt"  # dpo.reference = "model"; rl's reference
BAD_RECORDS = "bad_records.jsonl"


@dataclass
class PostTrainData:
    """The tokenized records of a post-training run."""

    tokenizer: Tokenizer
    template: ChatTemplate
    train: list  # sft: posttrain.sft_data.Tokenized; dpo: posttrain.dpo TokenizedPair
    val: list
    bad: list[BadRecord] = field(default_factory=list)
    val_reference: np.ndarray | None = None  # dpo, cached reference: the held-out pairs' log-probabilities
    val_prompts: list = field(default_factory=list)  # the held-out records' prompt turns (for samples)


class PostTraining:
    """The data hooks of a post-training objective (``train/modules.py::Objective``): ``[posttrain]``'s
    records checked (with the objective's own refusals), read and tokenized on every rank (the bad ones
    reported by the main one), the objective's loader over them; no validation token stream (the
    held-out records are in the data)."""

    def check(self, cfg: Config) -> None:
        check_posttrain(cfg)

    def prepare(self, cfg: Config, layout: Layout, run_dir: Path | None) -> PostTrainData:
        return prepare_posttrain(cfg, run_dir if layout.is_main else None)

    def loader(
        self, cfg: Config, data: PostTrainData, rank: int, world: int, run_dir: Path | None, accum: int
    ):
        return posttrain_loader(cfg, data, rank, world, run_dir, accum)

    def validation(self, data: PostTrainData) -> None:
        return None


def check_posttrain(cfg: Config) -> None:
    """What a post-training config must hold, checked before any work."""
    if cfg.train.objective == "lm":
        return
    if not cfg.posttrain.train_files:
        raise ConfigError(
            "posttrain.train_files: no records to train on; give --posttrain.train_files='[\"FILE.jsonl\"]' "
            "or a recipe with [posttrain] train_files"
        )
    for key in ("train_files", "val_files"):
        for path in getattr(cfg.posttrain, key):
            if not Path(path).is_file():
                raise ConfigError(f"posttrain.{key}: {path} is not a file; give JSONL record files")
    if cfg.train.objective == "dpo":
        check_dpo(cfg.dpo)
    if cfg.train.objective == "reward":
        check_reward_run(cfg)
    if cfg.train.objective == "dpo" and cfg.train.micro_batch_size == "auto":
        raise ConfigError(
            "train.micro_batch_size: auto sizes next-token batches, not DPO's pairs; give a number of pairs"
        )
    if cfg.train.objective == "rl":
        check_rl(cfg)


def check_rl(cfg: Config) -> None:
    """What an RL run must hold, checked before any work: the group, the room for completions, a reward
    that resolves (a reward run with the policy's tokenizer), a batch in prompts, a layout whose processes
    can each gather the whole policy to sample from (DDP, ZeRO-1, FSDP2 and hybrid sharding, tensor and
    expert parallelism; not offload; a pipeline is refused with the other objectives a pipeline cannot run,
    ``parallel/model_layout.py::PIPELINE_REFUSES``)."""
    rl, p = cfg.rl, cfg.parallel
    if rl.group_size < 2 and rl.algorithm != "ppo":  # PPO's baseline is its value head
        raise ConfigError(
            f"rl.group_size: {rl.group_size} completion per prompt gives no baseline to compare with; set 2 "
            "or more (e.g. 8)"
        )
    if rl.max_new_tokens >= cfg.data.seq_len:
        raise ConfigError(
            f"rl.max_new_tokens: {rl.max_new_tokens} leaves no room for a prompt within data.seq_len = "
            f"{cfg.data.seq_len}; lower it"
        )
    if cfg.train.micro_batch_size == "auto":
        raise ConfigError("train.micro_batch_size: auto sizes next-token batches; give a number of prompts")
    if rl.ppo_epochs * rl.mini_batches > 1 and cfg.train.batch_schedule.name != "constant":
        raise ConfigError(
            f"train.batch_schedule: a rollout cycle (rl.ppo_epochs = {rl.ppo_epochs}, rl.mini_batches = "
            f"{rl.mini_batches}) trains on a fixed number of micro-batches a step; use a constant batch "
            "(remove train.batch_schedule) or rl.ppo_epochs = rl.mini_batches = 1"
        )
    if p.offload:
        raise ConfigError(
            "parallel.offload: not with lmforge rl (each rollout gathers the policy's weights on the device); "
            "remove --parallel.offload"
        )
    check_reward(rl.reward, cfg.data.tokenizer)


def check_reward_run(cfg: Config) -> None:
    """What a reward run cannot do, refused before any work."""
    t, p = cfg.train, cfg.parallel
    refusals = [
        ("train.micro_batch_size", t.micro_batch_size == "auto", "give a number of pairs"),
        ("parallel.tp", p.tp > 1, "the reward head is not tensor-parallel; use data parallelism or FSDP"),
        ("train.sample_tokens", t.sample_tokens > 0, "a reward model does not generate; set it to 0"),
    ]
    for key, refused, fix in refusals:
        if refused:
            raise ConfigError(f"{key}: not with train.objective = reward: {fix}")


def prepare_posttrain(cfg: Config, run_dir: Path | None = None) -> PostTrainData:
    """Read and tokenize ``[posttrain]``'s records; report the bad ones (log, ``RUN/bad_records.jsonl``)."""
    data = read_posttrain(cfg)
    report_bad(data.bad, run_dir)
    return data


def read_posttrain(cfg: Config) -> PostTrainData:
    """``[posttrain]``'s records read and tokenized, the bad ones listed in ``bad``; a DataError naming the
    file when the training files hold no usable record (or none at all)."""
    tok = Tokenizer(cfg.data.tokenizer)
    template = ChatTemplate(tok)
    pt, seq_len = cfg.posttrain, cfg.data.seq_len
    data = PostTrainData(tok, template, [], [])
    for split, files in (("train", pt.train_files), ("val", pt.val_files)):
        key = f"posttrain.{split}_files"
        if cfg.train.objective == "rl":
            limit = seq_len + 1 - cfg.rl.max_new_tokens
            tokenized, bad = read_prompts(files, template, cfg.rl.template, limit, key)
            too_long, prompts = [], [(Turn("user", p.text),) for p in tokenized]
        elif cfg.train.objective == "sft":
            examples, bad = read_examples(files, pt.system_prompt, key=key)
            tokenized, too_long = tokenize_examples(examples, template, seq_len, pt.over_length)
            prompts = [prompt_turns(e.turns) for e in examples]
        else:
            pairs, bad = read_pairs(files, pt.system_prompt, key=key)
            tokenized, too_long = _tokenize_pairs(cfg, pairs, template)
            prompts = [p.prompt for p in pairs]
        setattr(data, split, tokenized)
        if split == "val":
            data.val_prompts = prompts
        data.bad += bad + too_long
        if split == "train" and not tokenized:
            raise DataError(no_record_message(key, files, bad + too_long))
    return data


def _tokenize_pairs(cfg: Config, pairs: list, template: ChatTemplate) -> tuple[list, list[BadRecord]]:
    """DPO: each side ``<= data.seq_len + 1`` ids (inputs and shifted targets); a reward model reads the
    whole sequence, so ``<= data.seq_len`` ids, with each record's margin."""
    pt, seq_len = cfg.posttrain, cfg.data.seq_len
    if cfg.train.objective != "reward":
        tokenized, skipped = tokenize_pairs(pairs, template.render, seq_len, pt.over_length)
        return tokenized, [BadRecord(*s) for s in skipped]
    tokenized, skipped = tokenize_pairs(pairs, template.render, seq_len - 1, pt.over_length)
    bad = [BadRecord(src, why.replace("data.seq_len+1", "data.seq_len")) for src, why in skipped]
    return reward_pairs(pairs, tokenized, cfg.reward.margin), bad


def no_record_message(key: str, files: list[str], problems: list[BadRecord]) -> str:
    """Why ``files`` gave nothing to train on: empty, or the first problem of their records."""
    if not problems:
        names = ", ".join(str(f) for f in files)
        return (
            f"{key}: {names} {'is' if len(files) == 1 else 'are'} empty (no JSONL record); give a file "
            "with one JSON record per line"
        )
    first = problems[0]
    return f"{key}: no usable record (first problem: {first.source}: {first.reason}); fix the records"


def prompt_turns(turns) -> tuple:
    """The turns before the last assistant turn: what a model is asked to answer."""
    last = max(i for i, t in enumerate(turns) if t.role == "assistant")
    return tuple(turns[:last])


def report_bad(bad: list[BadRecord], run_dir: Path | None) -> None:
    """One warning with the count and the first few, every one in ``RUN/bad_records.jsonl``."""
    if not bad:
        return
    shown = "; ".join(f"{b.source}: {b.reason}" for b in bad[:3])
    where = f" (all in {run_dir / BAD_RECORDS})" if run_dir is not None else ""
    log.warning(
        "posttrain: %d records skipped%s: %s%s", len(bad), where, shown, " ..." if len(bad) > 3 else ""
    )
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / BAD_RECORDS, "w") as f:
            f.writelines(json.dumps({"source": b.source, "reason": b.reason}) + "\n" for b in bad)


def posttrain_loader(
    cfg: Config, data: PostTrainData, rank: int, world: int, run_dir: Path | None, accum: int = 1
):
    """The training loader of the run's objective (a ``TrainLoader``); ``accum``: micro-batches a step
    (RL's rollout cycles count them)."""
    t = cfg.train
    pad = data.tokenizer.eot_id
    if t.objective == "sft":
        return SFTLoader(
            data.train, cfg.data.seq_len, t.micro_batch_size, t.seed, cfg.posttrain.packing, rank, world, pad
        )
    if t.objective == "rl":
        rl = cfg.rl
        return PromptLoader(
            data.train, t.micro_batch_size, t.seed, rank, world, pad, accum, rl.ppo_epochs, rl.mini_batches
        )
    if t.objective == "reward":
        return RewardPairLoader(data.train, cfg.data.seq_len, t.micro_batch_size, t.seed, rank, world, pad)
    loader = PairLoader(data.train, cfg.data.seq_len, t.micro_batch_size, t.seed, rank, world, pad)
    cached = load_reference(cfg, data, run_dir)
    if cached is not None:
        loader.set_reference(cached)
    return loader


def load_reference(cfg: Config, data: PostTrainData, run_dir: Path | None) -> np.ndarray | None:
    """With ``dpo.reference = "cached"`` and the run folder's ``reference_logps.npz`` written: the training
    pairs' reference log-probabilities (the held-out pairs' go to ``data.val_reference``)."""
    path = run_dir / REFERENCE_LOGPS if run_dir is not None else None
    if cfg.dpo.reference != "cached" or path is None or not path.is_file():
        return None
    cached = np.load(path)
    for split, pairs in (("train", data.train), ("val", data.val)):
        if len(cached[split]) != len(pairs):
            raise DataError(
                f"posttrain.{split}_files: {len(pairs)} pairs now, but {path} was computed for another set; "
                "keep the records of the run or start a new --run-dir"
            )
    data.val_reference = cached["val"]
    return cached["train"]


def dpo_objective(
    cfg: Config,
    policy: torch.nn.Module,
    new_model: Callable[[], torch.nn.Module],
    run_dir: Path | None,
    eval_policy: torch.nn.Module | None = None,
) -> DPOObjective:
    """The DPO objective over ``policy`` (the transformed :class:`SequenceLogps`; ``eval_policy``: the one
    evaluation runs, default ``policy``); with ``dpo.reference = "model"`` a frozen whole copy of the
    starting weights (``new_model()`` filled from ``RUN/reference_model.pt``) scores each batch."""
    reference = None
    if cfg.dpo.reference == "model" and run_dir is not None and (run_dir / REFERENCE_MODEL).is_file():
        frozen = new_model()
        saved = torch.load(run_dir / REFERENCE_MODEL, map_location="cpu", weights_only=True)
        shapes = {k: v.shape for k, v in frozen.state_dict().items()}
        frozen.load_state_dict(dense_base(saved, shapes))  # a LoRA run's start: the base, adapters dropped
        reference = SequenceLogps(frozen, cfg.train.loss_chunk)
    return DPOObjective.from_config(policy, cfg.dpo, reference, eval_policy)


def rl_objective(
    cfg: Config,
    policy: torch.nn.Module,
    model: torch.nn.Module,
    new_model: Callable[[], torch.nn.Module],
    run_dir: Path | None,
    device: torch.device | None = None,
    refresh_sampler: Callable[[], object] | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
) -> RLObjective:
    """The RL objective over ``policy`` (the transformed :class:`TokenLogps`), sampling from ``model``; the
    reference: a frozen whole copy (``new_model()``) of ``RUN/reference_model.pt`` when it exists (written
    when the run starts, :func:`write_reference`); a reward model (``rl.reward = "run:PATH"``) loaded on
    ``device`` (default: ``model``'s); ``refresh_sampler``: what brings ``model`` up to date before a
    rollout (FSDP2, tensor parallelism: the gather of ``parallel/whole_copy.py``); ``tp_group``: the
    tensor-parallel group whose first rank draws and scores the rollouts for all (None without)."""
    tok = Tokenizer(cfg.data.tokenizer)
    template = ChatTemplate(tok)
    rl = cfg.rl
    device = device if device is not None else next(model.parameters()).device
    reward = open_reward(
        rl.reward,
        rl.reward_timeout,
        rl.reward_workers,
        rl.failed_reward,
        device,
        rl.template,
        cfg.data.tokenizer,
        torch.float64 if cfg.train.precision == "fp64" else None,  # an fp64 run's rewards in fp64 too
    )
    kind = PPOObjective if rl.algorithm == "ppo" else RLObjective
    objective = kind(
        policy, model, rl, reward, stop_id(template, rl.template), tok.decode, tok.eot_id, cfg.train.seed,
        refresh_sampler=refresh_sampler, tp_group=tp_group,
    )  # fmt: skip
    if run_dir is not None and (run_dir / REFERENCE_MODEL).is_file():
        objective.set_reference(frozen_reference(new_model, run_dir, cfg.train.loss_chunk))
    return objective


def frozen_reference(new_model: Callable[[], torch.nn.Module], run_dir: Path, chunk: int) -> TokenLogps:
    """A :class:`TokenLogps` of the weights in ``RUN/reference_model.pt`` (a LoRA run's: its base, the
    adapters dropped; they start at ``B = 0``, so the base is the starting policy)."""
    frozen = new_model()
    saved = torch.load(run_dir / REFERENCE_MODEL, map_location="cpu", weights_only=True)
    frozen.load_state_dict(dense_base(saved, {k: v.shape for k, v in frozen.state_dict().items()}))
    return TokenLogps(frozen, chunk)


def write_reference(run, run_dir: Path) -> None:
    """At the start of a DPO run: the starting model's log-probabilities of every pair (cached) or its
    weights (model), into the run folder; of an RL run: its weights (the frozen reference)."""
    if run.cfg.train.objective == "rl" or run.cfg.dpo.reference == "model":
        torch.save(
            {k: v.detach().cpu() for k, v in run.model.state_dict().items()}, run_dir / REFERENCE_MODEL
        )
        return
    scorer = SequenceLogps(run.model, run.cfg.train.loss_chunk)
    seq_len, bs = run.cfg.data.seq_len, run.cfg.train.micro_batch_size
    arrays = {
        split: reference_logps(scorer, getattr(run.data, split), seq_len, bs, run.precision)
        for split in ("train", "val")
    }
    np.savez(run_dir / REFERENCE_LOGPS, **arrays)
    run.loader.set_reference(arrays["train"])
    run.data.val_reference = arrays["val"]


def posttrain_eval_batches(cfg: Config, data: PostTrainData) -> Iterable | None:
    """The held-out records as evaluation batches of the run's objective (None: no held-out records)."""
    if not data.val:
        return None
    bs = cfg.train.micro_batch_size
    if cfg.train.objective == "rl":
        return prompt_eval_batches(data.val, bs, data.tokenizer.eot_id)
    if cfg.train.objective == "sft":
        return sft_eval_batches(data.val, cfg.data.seq_len, bs, cfg.posttrain.packing)
    if cfg.train.objective == "reward":
        return reward_eval_batches(data.val, cfg.data.seq_len, bs, data.tokenizer.eot_id)
    return pair_eval_batches(data.val, cfg.data.seq_len, bs, data.val_reference, pad_id=data.tokenizer.eot_id)


def posttrain_validation(
    cfg: Config, data: PostTrainData, module, precision: PrecisionPolicy
) -> tuple[float | None, dict]:
    """``(validation loss, extra record entries)`` on the held-out records, by the training module's
    evaluation (``train/modules.py``): SFT's mean response-token loss; DPO's loss and its
    ``val_rewards/...`` metrics. ``None`` without held-out records."""
    batches = posttrain_eval_batches(cfg, data)
    if batches is None:
        return None, {}
    metrics = module.evaluate(batches, precision)
    return metrics["val_loss"], {k: v for k, v in metrics.items() if k != "val_loss"}


def chat_sample(model: torch.nn.Module, data: PostTrainData, prompt: str | None, n: int, seed: int) -> str:
    """``prompt`` (default: the first held-out record's prompt) as a user turn through the chat template,
    answered by ``model`` with up to ``n`` tokens (stopping at the template's end token)."""
    from lmforge.model.sampling import generate
    from lmforge.posttrain.records import Turn

    if prompt is not None or not data.val:
        turns = [Turn("user", prompt or "")]
    else:
        turns = list(data.val_prompts[0])
    ids = generate(model, data.template.prompt_ids(turns), n, stop_token=data.template.end_id, seed=seed)
    question = turns[-1].content
    return f"{question}\n--> {data.tokenizer.decode([i for i in ids if i != data.template.end_id])}"
