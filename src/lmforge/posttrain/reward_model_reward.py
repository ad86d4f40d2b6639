"""Rewards of RL runs from a trained reward model: ``rl.reward = "run:PATH"``, ``PATH`` a run of
``lmforge reward``.

**Checked before any work** (:func:`check_reward_run`, from ``posttrain/run.py::check_rl``): ``PATH`` is a
run folder (``config.toml``) of ``train.objective = reward`` with a complete checkpoint, and its tokenizer
is the policy's. The policy's completions are decoded to text and the reward model reads that text through
its own tokenizer, so two tokenizers with other ids, merges or normalisation would score something other
than what was sampled; :func:`tokenizer_difference` says which part differs (the vocabulary's size, the
first token id that maps to another token, or the section of ``tokenizer.json``: model, added tokens,
normaliser, pre-tokeniser, post-processor, decoder). Two post-training runs started ``--from`` the same
run have the same tokenizer (the chat tokens are added the same way).

**Loaded once** per process (:func:`open_reward_model`) on the policy's device: the newest checkpoint's
weights in a :class:`~lmforge.posttrain.reward.RewardModel` (a LoRA reward run merged, ``W + (alpha / r)
B A``), in eval mode, its parameters frozen; scoring runs under ``torch.no_grad`` in the reward run's
precision. It is a whole copy in every process, beside the policy's reference.

**What is scored**: each ``(prompt, completion)`` text pair, as :func:`lmforge.evaluate.reward.score`
scores a text (the same :class:`RewardScorer`). With ``rl.template = "chat"`` the pair is rendered by the
chat template as the reward model's training pairs were, the prompt a user turn and the completion the
assistant's, closed by ``<|end|>\\n`` (:meth:`RewardScorer.chat_ids`, the ids of the text
``<|endoftext|><|user|>\\nPROMPT<|end|>\\n<|assistant|>\\nCOMPLETION<|end|>\\n``; a completion cut at
``rl.max_new_tokens`` is closed the same way); with ``"none"`` it is the text
``<|endoftext|>PROMPT COMPLETION`` (no separator) encoded whole. At most the reward run's ``data.seq_len``
ids are read, **the end kept** (:func:`keep_end`): a longer sequence loses the start of its prompt, right
after its first id when that is the document start ``<|endoftext|>`` (every training sequence began with
it), so the last token, the one the reward head reads, is always the completion's own end (its closing
``<|end|>\n`` in the chat form). Cutting the end instead would score every long completion of one prompt
at the same token, with the same reward. Every sample gets a finite reward: none is counted as failed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from lmforge.config import Config
from lmforge.errors import ConfigError
from lmforge.model.lora import merged_state
from lmforge.posttrain.records import Turn
from lmforge.posttrain.reward import RewardModel
from lmforge.posttrain.reward_fn import Scores
from lmforge.posttrain.template import ChatTemplate
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_saved_config
from lmforge.tokenizer import EOT, Tokenizer

PREFIX = "run:"
SCORE_BATCH = 16  # rows a reward forward reads at once (the default of evaluate/reward.py's score())
SECTIONS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")


def keep_end(ids: Sequence[int], seq_len: int, bos_id: int) -> list[int]:
    """``ids`` within ``seq_len``, the end kept: a longer sequence keeps its last ``seq_len`` ids, or, when it
    starts with the document start ``bos_id`` (``<|endoftext|>``), that id and the last ``seq_len - 1``; a
    sequence that fits is returned whole."""
    ids = list(ids)
    if len(ids) <= seq_len:
        return ids
    if ids[0] == bos_id and seq_len > 1:
        return [bos_id, *ids[len(ids) - (seq_len - 1) :]]
    return ids[len(ids) - seq_len :]


@dataclass
class RewardScorer:
    """A reward-model run loaded for scoring: its model, tokenizer, context length and precision."""

    model: RewardModel
    tokenizer: Tokenizer
    seq_len: int
    precision: PrecisionPolicy

    def fit(self, ids: Sequence[int]) -> list[int]:
        """``ids`` within ``seq_len``, the end kept (:func:`keep_end`: the scored last token stays)."""
        return keep_end(ids, self.seq_len, self.tokenizer.eot_id)

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, at most ``seq_len``: a longer one loses the start of its text (:meth:`fit`)."""
        return [self.fit(ids) for ids in self.tokenizer.encode_batch(list(texts))]

    def chat_ids(self, chats: Sequence[tuple[str, str]]) -> list[list[int]]:
        """Each ``(prompt, response)`` rendered by the chat template (a user turn, the assistant's answer),
        the ids training used for its pairs, at most ``seq_len``: a longer one loses the start of its
        prompt, after the leading ``<|endoftext|>`` (:meth:`fit`)."""
        template = ChatTemplate(self.tokenizer)
        return [self.fit(template.render((Turn("user", p), Turn("assistant", r)))[0]) for p, r in chats]

    @torch.no_grad()
    def score_ids(self, rows: Sequence[Sequence[int]], batch_size: int = SCORE_BATCH) -> list[float]:
        """The rewards of token-id sequences, in order (right-padded with ``<|endoftext|>`` in batches)."""
        pad, out = self.tokenizer.eot_id, []
        device = self.precision.device
        self.model.eval()
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            width = max(len(r) for r in chunk)
            inputs = torch.full((len(chunk), width), pad, dtype=torch.long)
            for i, r in enumerate(chunk):
                inputs[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
            with self.precision.autocast():
                out += self.model.rewards(inputs.to(device), pad).double().cpu().tolist()
        return out


def reward_run_of(spec: str) -> Path | None:
    """The folder ``rl.reward = "run:PATH"`` names (None for a ``module:function``)."""
    return Path(spec.removeprefix(PREFIX)) if spec.startswith(PREFIX) else None


def _complete_checkpoints(run: Path) -> list[Path]:
    # train/ sits above posttrain/: imported here only (tests/test_import_direction.py::EXCEPTIONS)
    from lmforge.train.checkpoint import list_checkpoints

    return list_checkpoints(run)


def reward_run_config(run: Path) -> Config:
    """The config of the reward run ``run``, or a ConfigError naming ``rl.reward`` and the fix: a folder
    that is no run, a run of another objective, a run without a complete checkpoint."""
    where = f"rl.reward: run:{run}"
    if not (run / "config.toml").is_file():
        raise ConfigError(
            f"{where} is not an lmforge run folder (no config.toml); give a reward run (lmforge reward --from RUN)"
        )
    cfg = load_saved_config(run / "config.toml")
    if cfg.train.objective != "reward":
        raise ConfigError(
            f"{where} is a train.objective = {cfg.train.objective} run, not a reward model; train one with "
            "lmforge reward --from RUN"
        )
    if not (run / "tokenizer.json").is_file():
        raise ConfigError(f"{where} has no tokenizer.json; give the reward run's own folder")
    if not _complete_checkpoints(run):
        raise ConfigError(f"{where} has no complete checkpoint yet; let the reward run save one")
    return cfg


def tokenizer_difference(policy: str | Path, reward: str | Path) -> str | None:
    """What tells the reward run's ``tokenizer.json`` from the policy's (None: they encode alike): the
    vocabulary's size, the first id mapped to another token, else the first differing section."""
    policy, reward = Path(policy), Path(reward)
    if policy.read_bytes() == reward.read_bytes():
        return None
    mine = HFTokenizer.from_file(str(policy)).get_vocab(with_added_tokens=True)
    theirs = HFTokenizer.from_file(str(reward)).get_vocab(with_added_tokens=True)
    if len(mine) != len(theirs):
        return f"its vocabulary has {len(theirs)} tokens, the policy's {len(mine)}"
    if mine != theirs:
        by_id = {i: t for t, i in mine.items()}
        their_id = {i: t for t, i in theirs.items()}
        first = min(i for i in by_id if their_id.get(i) != by_id[i])
        return f"token id {first} is {their_id.get(first)!r} there, {by_id[first]!r} in the policy's"
    a, b = json.loads(policy.read_text()), json.loads(reward.read_text())
    for key in SECTIONS:
        if a.get(key) != b.get(key):
            what = "model (merges or scores)" if key == "model" else key.replace("_", "-")
            return f"the same vocabulary but another {what}"
    return None  # the same tokenizer written differently


def check_reward_run(spec: str, policy_tokenizer: str | Path | None) -> None:
    """``rl.reward = "run:PATH"`` checked before any work: a reward run (:func:`reward_run_config`) whose
    tokenizer is the policy's (``data.tokenizer``; None: not compared)."""
    run = reward_run_of(spec)
    reward_run_config(run)
    if policy_tokenizer is None or not Path(policy_tokenizer).is_file():
        return
    why = tokenizer_difference(policy_tokenizer, run / "tokenizer.json")
    if why is not None:
        raise ConfigError(
            f"rl.reward: the tokenizer of run:{run} differs from the policy's (data.tokenizer = "
            f"{policy_tokenizer}): {why}; train the reward model from the policy's starting run (lmforge "
            "reward --from RUN) so both read the same ids"
        )


def load_reward_scorer(run: str | Path, device: torch.device | str = "cpu") -> RewardScorer:
    """The newest checkpoint of the reward run ``run`` on ``device``, frozen, in eval mode (a LoRA run's
    adapters merged into its weights)."""
    from lmforge.train.checkpoint import load_checkpoint  # see _complete_checkpoints

    run, device = Path(run), torch.device(device)
    cfg = reward_run_config(run)
    tok = Tokenizer(run / "tokenizer.json")
    with torch.device("meta"):
        model = RewardModel(
            cfg.model, tok.vocab_size, cfg.data.seq_len, cfg.train.attention, cfg.train.moe_kernel
        )
    model.materialize(device)
    state = load_checkpoint(_complete_checkpoints(run)[-1])["model"]
    if cfg.lora.rank:
        state = merged_state(state, cfg.lora, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    return RewardScorer(model, tok, cfg.data.seq_len, PrecisionPolicy.resolve(cfg.train.precision, device))


class RewardModelReward:
    """The :class:`~lmforge.posttrain.reward_pool.RewardFn` of a reward model: ``(prompt, completion)``
    pairs scored by ``scorer`` (``template``: ``rl.template``; the module docstring says what is read)."""

    def __init__(self, scorer: RewardScorer, template: str = "chat"):
        self.scorer, self.template = scorer, template

    def rows(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        pairs = list(zip(prompts, completions, strict=True))
        if self.template == "chat":
            return self.scorer.chat_ids(pairs)
        return self.scorer.ids([f"{EOT}{p}{c}" for p, c in pairs])

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> Scores:
        return Scores(self.scorer.score_ids(self.rows(prompts, completions)), 0)

    def close(self) -> None:
        return None


def open_reward_model(
    spec: str,
    device: torch.device | str,
    template: str,
    policy_tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> RewardModelReward:
    """The reward ``rl.reward = "run:PATH"`` names, checked (:func:`check_reward_run`) and loaded once
    (weights in ``dtype``: an fp64 policy run scores in float64, so its rewards do not hang on how a
    batch's rows are split over ranks)."""
    check_reward_run(spec, policy_tokenizer)
    scorer = load_reward_scorer(reward_run_of(spec), device)
    if dtype is not None:
        scorer.model.to(dtype)
    return RewardModelReward(scorer, template)
