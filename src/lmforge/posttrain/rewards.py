"""Verifiable rewards shipped with lmforge (``rl.reward = "lmforge.posttrain.rewards:NAME"``) and the
addition task of the RL demonstration.

A reward is any function ``(prompt: str, completion: str) -> float`` importable by name; lmforge calls it
in a sandbox process with a time limit (``posttrain/reward_pool.py``). This module imports nothing heavy,
so the sandbox starts fast.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

_PROBLEM = re.compile(r"(\d+)\s*\+\s*(\d+)\s*=\s*$")
_ANSWER = re.compile(r"\s*(-?\d+)")


def addition(prompt: str, completion: str) -> float:
    """1.0 when the completion starts (after spaces) with the sum of the ``A+B=`` that ends the prompt and
    nothing but spaces follows the number; else 0.0. A prompt that holds no ``A+B=`` scores 0."""
    problem = _PROBLEM.search(prompt)
    answer = _ANSWER.match(completion)
    if problem is None or answer is None or completion[answer.end() :].strip():
        return 0.0
    return float(int(answer.group(1)) == int(problem.group(1)) + int(problem.group(2)))


def addition_digits(prompt: str, completion: str) -> float:
    """Partial credit for the ``A+B=`` task: the share of digit places (aligned from the right, over the
    longer of the completion's number and the sum) where the completion's number has the sum's digit;
    1.0 exactly when :func:`addition` gives 1, 0 when the completion holds no number alone."""
    problem = _PROBLEM.search(prompt)
    answer = _ANSWER.match(completion)
    if problem is None or answer is None or completion[answer.end() :].strip():
        return 0.0
    got, want = answer.group(1), str(int(problem.group(1)) + int(problem.group(2)))
    width = max(len(got), len(want))
    same = sum(a == b for a, b in zip(got.rjust(width), want.rjust(width), strict=True))
    return same / width


def addition_problems(n: int, seed: int, digits: int = 2) -> list[tuple[int, int]]:
    """``n`` pairs of ``digits``-digit numbers drawn with ``seed``."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits - 1
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(n)]


def write_addition(folder: str | Path, n_lines: int, n_prompts: int, n_val: int, seed: int = 0) -> dict:
    """The demonstration's files in ``folder``: ``lines.jsonl`` (``{"id": "addition-N", "text": "12+34=46"}``
    documents for a base model), ``prompts.jsonl`` and ``prompts_val.jsonl`` (``{"prompt": "12+34="}`` records for
    ``lmforge rl``), the held-out problems never among the others. Returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    problems = list(dict.fromkeys(addition_problems(4 * (n_lines + n_prompts + n_val), seed)))
    val = problems[:n_val]
    rest = problems[n_val:]
    files = {
        # an id of its own per document: the held-out split (a hash of the id) and hence the tokenizer and
        # the base model are then the same whatever folder the files are written to (the default id is
        # the file's path and line)
        "lines": [
            {"id": f"addition-{i}", "text": f"{a}+{b}={a + b}"} for i, (a, b) in enumerate(rest[:n_lines])
        ],
        "prompts": [{"prompt": f"{a}+{b}="} for a, b in rest[n_lines : n_lines + n_prompts]],
        "prompts_val": [{"prompt": f"{a}+{b}="} for a, b in val],
    }
    out = {}
    for name, records in files.items():
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        out[name] = str(path)
    return out
