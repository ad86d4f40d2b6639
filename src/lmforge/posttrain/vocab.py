"""Growing a model's vocabulary for tokens added after pretraining (the chat template's special tokens).

A new token has no trained embedding. Each new row of the input embedding and of an untied output head
starts as the mean of that matrix's existing rows:

    E'[v] = E[v]                     for v < V_old
    E'[v] = (1 / V_old) sum_u E[u]   for V_old <= v < V_new

(Hewitt, "Initializing New Word Embeddings for Pretrained Language Models", 2021): the mean row keeps the new
tokens' logits at the average of the old ones, so the pretrained model's distribution over the old tokens
barely moves (a zero or random row would either vanish or spike). With tied embeddings the one matrix grows
once. GPT-2-style learned positions are not touched.
"""

from __future__ import annotations

import torch

GROWN = ("embed.weight", "lm_head.weight")


def grow_rows(weight: torch.Tensor, new_rows: int) -> torch.Tensor:
    """``weight`` (V_old x d) with ``new_rows - V_old`` rows appended, each the mean of the old rows
    (computed in FP32, stored in ``weight``'s dtype)."""
    old = weight.shape[0]
    if new_rows < old:
        raise ValueError(f"cannot shrink a vocabulary from {old} to {new_rows} rows")
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(new_rows - old, -1)], dim=0)


def grow_vocab(state: dict[str, torch.Tensor], new_vocab: int) -> dict[str, torch.Tensor]:
    """A model state dict with its embedding and (untied) output head grown to ``new_vocab`` rows; the
    other tensors are the same objects."""
    return {k: grow_rows(v, new_vocab) if k in GROWN else v for k, v in state.items()}
