"""What an RL objective scores completions with: the :class:`RewardFn` protocol and its :class:`Scores`.

Two kinds follow it, both opened by ``posttrain/reward_pool.py::open_reward`` from ``rl.reward``: a Python
function in a sandbox of processes (``reward_pool.py::RewardPool``) and a trained reward model
(``reward_model_reward.py::RewardModelReward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Scores:
    rewards: list[float]
    failed: int  # calls that raised, timed out or returned no finite number
    first_error: str | None = None


class RewardFn(Protocol):
    """What an RL objective scores completions with."""

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> Scores: ...

    def close(self) -> None: ...
