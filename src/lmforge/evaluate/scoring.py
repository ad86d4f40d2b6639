"""The scoring rules of downstream tasks: pure functions of scores and texts (docs/evaluation.md).

* ``acc``: a multiple-choice question is right when its answer's log-likelihood
  ``ll_j = log p(choice_j | context)`` is the largest of its choices' (``argmax_j ll_j``);
* ``acc_norm``: the same with ``ll_j / bytes_j``, ``bytes_j`` the UTF-8 length of choice ``j`` (without
  the delimiter before it), as HellaSwag and ARC are scored: long choices are not penalised for their
  length;
* ``exact_match``: a generated text, cut at the first stop string and passed through the extractor (a
  regular expression, or none), equals the answer once both are stripped of surrounding whitespace;
* the standard error of an accuracy over ``n`` questions (:func:`binomial_stderr`), and bits per byte of a
  loss (:func:`bits_per_byte`).

Ties go to the first choice of the largest score (``argmax``), as lm-evaluation-harness's ``np.argmax``.
"""

from __future__ import annotations

import math
import re

INVALID = "[invalid]"  # what the extractor gives when its pattern does not match (lm-evaluation-harness's)


def argmax(values: list[float]) -> int:
    """Index of the first largest value."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def choice_correct(logprobs: list[float], choices: list[str], answer: int) -> tuple[bool, bool]:
    """``(acc, acc_norm)`` of one question: is ``answer`` the argmax of the log-likelihoods, and of the
    log-likelihoods divided by each choice's length in UTF-8 bytes."""
    norm = [lp / max(len(c.encode("utf-8")), 1) for lp, c in zip(logprobs, choices, strict=True)]
    return argmax(logprobs) == answer, argmax(norm) == answer


def cut_at_stops(text: str, stops: list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    end = len(text)
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at != -1:
            end = min(end, at)
    return text[:end]


def extract(text: str, pattern: str | None, group_select: int = 0) -> str:
    """The answer in a generated ``text``: the whole text without a pattern; else the ``group_select``-th
    match of ``re.findall(pattern, text)`` (a pattern with groups: the first non-empty group of that
    match), stripped, or ``[invalid]`` without a match (lm-evaluation-harness's ``regex`` filter)."""
    if pattern is None:
        return text.strip()
    found = re.findall(pattern, text)
    if not found:
        return INVALID
    try:
        match = found[group_select]
    except IndexError:
        return INVALID
    if isinstance(match, tuple):
        match = next((m for m in match if m), "")
    return match.strip()


def exact_match(prediction: str, answer: str) -> bool:
    """The prediction equals the answer after stripping surrounding whitespace from both."""
    return prediction.strip() == answer.strip()


def binomial_stderr(acc: float, n: int) -> float:
    """Standard error of the mean of ``n`` right/wrong outcomes with mean ``acc``:

        se = sqrt(acc (1 - acc) / (n - 1))

    the sample standard deviation ``sqrt(n acc (1 - acc) / (n - 1))`` over ``sqrt(n)``, as
    lm-evaluation-harness reports it (``mean_stderr``); NaN for fewer than two outcomes."""
    if n < 2:
        return math.nan
    return math.sqrt(max(acc * (1.0 - acc), 0.0) / (n - 1))


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """``nats / (ln 2 x bytes)``: a summed cross-entropy in nats as bits per UTF-8 byte of the text."""
    return nats / (math.log(2) * n_bytes)
