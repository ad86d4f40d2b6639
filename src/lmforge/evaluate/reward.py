"""Scoring texts with a reward-model run (``lmforge reward``): what RL code calls for rewards.

    from lmforge.evaluate.reward import load_reward_model, score
    rewards = score("runs/reward", ["<|endoftext|><|user|>\\nQ<|end|>\\n<|assistant|>\\nA<|end|>\\n"])
    scorer = load_reward_model("runs/reward")      # load once, score many times
    rewards = score(scorer, texts)
    rewards = score_chats(scorer, [(prompt, response), ...])  # rendered by the chat template

A text is encoded whole by the run's tokenizer, as the exported Hugging Face tokenizer encodes it (a chat
marker's text is the marker); a longer one keeps its last ``data.seq_len`` ids (after its leading
``<|endoftext|>``, which stays: ``reward_model_reward.py::keep_end``), so the token it is scored at, its
last real one (``posttrain/reward.py``), is the text's own end. Scored in the run's precision, in eval
mode. :class:`RewardScorer` (the
scoring itself) lives in ``posttrain/reward_model_reward.py``, where ``rl.reward = "run:PATH"`` scores RL
completions with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.evaluate.run_loading import load_run
from lmforge.posttrain.reward_model_reward import SCORE_BATCH, RewardScorer
from lmforge.precision import PrecisionPolicy

__all__ = ["RewardScorer", "load_reward_model", "score", "score_chats"]


def load_reward_model(
    run: str | Path, device: torch.device | str = "cpu", step: int | None = None
) -> RewardScorer:
    """The reward model of ``run``'s checkpoint ``step`` (None: the newest) on ``device``; a UserError for a
    run that is no reward run."""
    device = torch.device(device)
    cfg, tok, model, _ = load_run(Path(run), device, step)
    if cfg.train.objective != "reward":
        raise UserError(
            f"RUN: {run} is a train.objective = {cfg.train.objective} run, not a reward model; train one with "
            "lmforge reward --from RUN"
        )
    return RewardScorer(model, tok, cfg.data.seq_len, PrecisionPolicy.resolve(cfg.train.precision, device))


def score(run: str | Path | RewardScorer, texts: Sequence[str], batch_size: int = SCORE_BATCH) -> list[float]:
    """One reward per text of ``texts``, in order (``run``: a reward run folder, or a
    :class:`RewardScorer` from :func:`load_reward_model` to load it once). Empty texts are refused."""
    scorer = run if isinstance(run, RewardScorer) else load_reward_model(run)
    rows = scorer.ids(texts)
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise UserError(f"texts: text {empty[0]} encodes to no token; give a prompt and a response to score")
    return scorer.score_ids(rows, batch_size)


def score_chats(
    run: str | Path | RewardScorer, chats: Sequence[tuple[str, str]], batch_size: int = SCORE_BATCH
) -> list[float]:
    """One reward per ``(prompt, response)`` of ``chats``: the prompt as a user turn, the response as the
    assistant's, rendered into ids by the run's chat template exactly as training rendered its pairs (a
    longer one than ``data.seq_len`` loses the start of its prompt, as :func:`score`'s texts do)."""
    scorer = run if isinstance(run, RewardScorer) else load_reward_model(run)
    return scorer.score_ids(scorer.chat_ids(chats), batch_size)
