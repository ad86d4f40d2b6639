"""A reward model (``posttrain/reward.py``) as a Hugging Face sequence-classification checkpoint.

The causal-LM export of the same network (``llama.py`` / ``gpt2.py``) with three changes:

* the class: ``LlamaForSequenceClassification`` / ``GPT2ForSequenceClassification`` (the transformer
  under ``model.`` / ``transformer.`` as in the causal LM, and ``score``, ``Linear(hidden, 1,
  bias=False)``, in place of ``lm_head``);
* ``num_labels = 1`` (one scalar per sequence, as TRL's reward models) and ``pad_token_id`` = the
  tokenizer's ``<|endoftext|>``: those classes then pool the rightmost token that is not the padding id,
  the token lmforge's reward is read at (``posttrain/reward.py::last_token_index``);
* ``score.weight`` = lmforge's ``score.weight``; no ``lm_head`` (``tie_word_embeddings`` false).
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.hf.common import refuse_export

CLASSES = {
    "LlamaForCausalLM": "LlamaForSequenceClassification",
    "GPT2LMHeadModel": "GPT2ForSequenceClassification",
}


def sequence_classification(
    hf_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    pad_id: int,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, tensors)`` of the causal-LM export turned into the reward model's: see the module
    docstring. ``state``: lmforge's tensors (for ``score.weight``). A mixture of experts is refused."""
    causal = hf_config["architectures"][0]
    if causal not in CLASSES:
        raise refuse_export(
            "model.moe.experts", causal, "a reward model exports from a dense llama or gpt2 only"
        )
    config = {
        **hf_config,
        "architectures": [CLASSES[causal]],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "pad_token_id": pad_id,
        "tie_word_embeddings": False,
    }
    out = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    out["score.weight"] = state["score.weight"]
    return config, out
