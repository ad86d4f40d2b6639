"""``lmforge generate``: text sampled from a run's checkpoint (``model/sampling.py``).

A post-training run (its folder holds a chat template) is prompted as its training saw prompts: the text
as a user turn, answered up to the template's end token, and only the answer is shown. Any other run
continues the text after ``<|endoftext|>`` and the text is shown with its continuation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.evaluate.run_loading import load_run
from lmforge.model.sampling import generate
from lmforge.posttrain.records import Turn
from lmforge.posttrain.template import ChatTemplate, read_template
from lmforge.tokenizer import Tokenizer


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int, top_p: float, num_samples: int
) -> None:
    """UserError naming the first ``generate`` flag out of its range."""
    rules = [
        ("--max-new-tokens", max_new_tokens, max_new_tokens >= 1, "an integer >= 1"),
        ("--temperature", temperature, temperature >= 0, "a number >= 0 (0: greedy decoding)"),
        ("--top-k", top_k, top_k >= 0, "an integer >= 0 (0: no top-k cut)"),
        ("--top-p", top_p, 0 < top_p <= 1, "a number in (0, 1] (1: no nucleus cut)"),
        ("--num-samples", num_samples, num_samples >= 1, "an integer >= 1"),
    ]
    for flag, value, ok, want in rules:
        if not ok or value != value:  # NaN fails every comparison but the last
            raise UserError(f"{flag}: {value} is out of range; give {want}")


def prompt_of(tok: Tokenizer, template: ChatTemplate | None, prompt: str) -> tuple[list[int], int, str]:
    """``(ids, stop token, text shown before the sample)`` of ``prompt``: a chat run's user turn up to the
    assistant's turn, stopping at ``<|end|>``; else ``<|endoftext|>`` + the text (the exported tokenizer
    adds the same ``<|endoftext|>``), stopping at the next one."""
    if template is not None:
        return template.prompt_ids([Turn("user", prompt)]), template.end_id, ""
    return [tok.eot_id, *tok.encode(prompt)], tok.eot_id, prompt


def samples(
    run_dir: str | Path,
    prompt: str,
    device: torch.device,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    top_p: float = 0.95,
    num_samples: int = 1,
    seed: int = 0,
) -> Iterator[str]:
    """``num_samples`` texts from the newest checkpoint of ``run_dir``, one at a time (sample ``i`` with
    seed ``seed + i``); the arguments are checked before the run is loaded."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, num_samples)
    _, tok, model, _ = load_run(run_dir, device)
    ids, stop, shown = prompt_of(tok, read_template(Path(run_dir)), prompt)
    for i in range(num_samples):
        out = generate(
            model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_token=stop,
            seed=seed + i,
        )
        yield shown + tok.decode([t for t in out if t != stop])
