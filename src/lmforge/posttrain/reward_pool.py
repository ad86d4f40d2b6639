"""Rewards of RL runs: ``rl.reward`` resolved, and called in a sandbox of worker processes.

``rl.reward = "module:function"`` names a function ``(prompt, completion) -> number``. It is imported
once in lmforge's process to check it exists (an unknown one is a one-line error before any work), then
called in ``rl.reward_workers`` spawned processes (its own interpreter: a crash, ``sys.exit`` or a hang
does not touch training). Each call has ``rl.reward_timeout`` seconds: a timer in the worker raises in
the function when it is up (``SIGALRM``); a worker that dies or does not answer within the whole batch's
allowance is replaced. A call that raises, times out, or returns no finite number scores
``rl.failed_reward`` and is counted as failed; the run goes on.

``rl.reward = "run:PATH"`` names a reward model trained by ``lmforge reward``
(``posttrain/reward_model_reward.py``: loaded once in lmforge's process, no sandbox). :func:`open_reward`
is the one place that turns the setting into a :class:`RewardFn`.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lmforge.errors import ConfigError
from lmforge.posttrain.reward_fn import RewardFn, Scores

if TYPE_CHECKING:
    import torch

__all__ = ["RewardFn", "RewardPool", "Scores", "check_reward", "open_reward", "resolve"]

RUN = "run:"  # rl.reward = "run:PATH": a reward-model run
_FUNCTIONS: dict[str, Callable] = {}  # a worker's resolved rewards


def resolve(spec: str) -> Callable:
    """The function ``module:function`` names, or a ConfigError naming ``rl.reward`` and the fix."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(
            f"rl.reward: {spec!r} is not module:function; give e.g. lmforge.posttrain.rewards:addition"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(
            f"rl.reward: cannot import module {module!r} ({exc}); check the name and path"
        ) from None
    except AttributeError:
        raise ConfigError(f"rl.reward: module {module!r} has no {name!r}; name a function in it") from None
    if not callable(fn):
        raise ConfigError(
            f"rl.reward: {spec} is not a function; name a function (prompt, completion) -> float"
        )
    return fn


def check_reward(spec: str, policy_tokenizer: str | Path | None = None) -> None:
    """``rl.reward`` checked before any work (``run:PATH``: a reward run whose tokenizer is
    ``policy_tokenizer``'s, ``posttrain/reward_model_reward.py``)."""
    if spec.startswith(RUN):
        from lmforge.posttrain.reward_model_reward import check_reward_run  # the sandbox's workers skip torch

        check_reward_run(spec, policy_tokenizer)
        return
    resolve(spec)


def open_reward(
    spec: str,
    timeout: float,
    workers: int,
    failed_value: float,
    device: torch.device | str = "cpu",
    template: str = "chat",
    policy_tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> RewardFn:
    """The scorer ``rl.reward`` names: a function in a :class:`RewardPool`, or (``run:PATH``) the reward
    model loaded on ``device`` (its weights in ``dtype``, default its run's) scoring as ``template``
    (``rl.template``) renders."""
    if spec.startswith(RUN):
        from lmforge.posttrain.reward_model_reward import open_reward_model

        return open_reward_model(spec, device, template, policy_tokenizer, dtype)
    check_reward(spec)
    return RewardPool(spec, timeout, workers, failed_value)


def _alarm(signum, frame):
    raise TimeoutError("reward call timed out")


def _call(spec: str, prompt: str, completion: str, timeout: float) -> tuple[float | None, str | None]:
    """In a worker: ``(reward, None)`` or ``(None, why it failed)``."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        fn = _FUNCTIONS.get(spec)
        if fn is None:
            fn = _FUNCTIONS[spec] = resolve(spec)
        value = float(fn(prompt, completion))
        if not math.isfinite(value):
            return None, f"returned {value}"
        return value, None
    except BaseException as exc:  # the sandbox: any failure of the user function
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RewardPool:
    """``spec``'s function called in ``workers`` spawned processes, ``timeout`` seconds a call; failures
    score ``failed_value``."""

    def __init__(self, spec: str, timeout: float, workers: int, failed_value: float):
        self.spec, self.timeout, self.workers, self.failed_value = spec, timeout, workers, failed_value
        self._pool = None

    def _start(self):
        if self._pool is None:
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers)
        return self._pool

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> Scores:
        """One reward per ``(prompt, completion)``, in order."""
        pool = self._start()
        calls = [
            pool.apply_async(_call, (self.spec, p, c, self.timeout))
            for p, c in zip(prompts, completions, strict=True)
        ]
        # the backstop of a worker that died or ignores its timer: the batch's whole allowance and a margin
        deadline = time.monotonic() + self.timeout * (1 + math.ceil(len(calls) / self.workers)) + 10
        rewards, failed, first, stuck = [], 0, None, False
        for call in calls:
            try:
                value, error = call.get(max(0.0, deadline - time.monotonic()))
            except multiprocessing.TimeoutError:
                value, error, stuck = None, f"no answer within {self.timeout:g} s (worker replaced)", True
            if value is None:
                failed += 1
                first = first or error
                value = self.failed_value
            rewards.append(value)
        if stuck:
            self.close()
        return Scores(rewards, failed, first)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
