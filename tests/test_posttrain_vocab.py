"""Growing the vocabulary for the chat template's tokens: new rows are the mean of the old ones."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.posttrain.vocab import grow_rows, grow_vocab
from tests.conftest import model_of


def test_new_rows_are_the_mean_and_old_rows_stay():
    torch.manual_seed(0)
    w = torch.randn(5, 3)
    grown = grow_rows(w, 8)
    assert grown.shape == (8, 3)
    assert torch.equal(grown[:5], w)
    for row in grown[5:]:  # an FP32 mean of 5 values: one or two roundings (measured equal); 1e-6 is 8 ulps
        assert torch.allclose(row, torch.tensor([w[:, j].sum().item() / 5 for j in range(3)]), atol=1e-6)
    with pytest.raises(ValueError):
        grow_rows(w, 4)


@pytest.mark.parametrize("tied", [True, False])
def test_grown_model_keeps_the_old_tokens_logits_order(tied):
    """A grown model loads the grown state; on old-token inputs its logits over the old tokens are the old
    model's, and each new token's logit is the mean of the old logits (mean row of the head)."""
    torch.manual_seed(1)
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, tie_embeddings=tied)
    old = model_of(cfg, 20, 8)
    state = grow_vocab(old.state_dict(), 24)
    new = model_of(cfg, 24, 8)
    new.load_state_dict(state)
    x = torch.randint(0, 20, (2, 8))
    with torch.no_grad():
        lo, ln = old.logits(old(x)), new.logits(new(x))
    # old tokens: the same FP32 products, measured equal; the new rows' logits are products with a mean row,
    # an FP32 mean of 20 rows in another order (measured 7.5e-9 on logits of 0.03); 1e-5 is FP32 room
    assert torch.allclose(ln[..., :20], lo, atol=1e-5)
    # the new tokens: the mean-row bound above (1e-5)
    assert torch.allclose(ln[..., 20:], lo.mean(-1, keepdim=True).expand(-1, -1, 4), atol=1e-5)
