"""Reward functions the RL tests name (``rl.reward = "tests.rl_rewards:NAME"``): imported in the reward
sandbox's processes."""

from __future__ import annotations

import time


def length(prompt: str, completion: str) -> float:
    """A reward any completion gets a spread of: its length modulo 4, over 3."""
    return (len(completion) % 4) / 3


def raises(prompt: str, completion: str) -> float:
    raise RuntimeError("a broken reward")


def hangs(prompt: str, completion: str) -> float:
    time.sleep(60)
    return 1.0


def flaky(prompt: str, completion: str) -> float:
    """Raises for prompts with ``boom``, hangs for prompts with ``hang``, else :func:`length`."""
    if "boom" in prompt:
        raise ValueError("boom")
    if "hang" in prompt:
        time.sleep(60)
    return length(prompt, completion)
