"""A tied embedding held by two pipeline stages (``parallel/tied_embedding.py``), in one process: the
gradient sum of copies on one rank, the optimizer groups of the head's copy, the norm that counts the
matrix once, and the checkpoint keys, which must be one process's. The pipelines themselves (two and
three ranks, every schedule, FSDP2) are ``tests/test_pipeline_parallel.py`` and
``tests/test_distributed.py`` (marker ``distributed``)."""

from __future__ import annotations

import pytest
import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer, param_groups
from lmforge.optim.clip import Clipper
from lmforge.parallel.pipeline import build_stage, rank_model
from lmforge.parallel.tied_embedding import TiedEmbedding
from lmforge.train.checkpoint import load_optimizer_state, optimizer_state

CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, tie_embeddings=True)
VOCAB, SEQ, SEED = 32, 8, 3
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1, fused=False)


def build() -> Transformer:
    return Transformer(CFG, VOCAB, SEQ)


def whole() -> Transformer:
    return build_stage(build, range(0, CFG.n_layers), "cpu", SEED)


def stages() -> tuple[Transformer, Transformer]:
    """Stage 0 (embedding, block 0) and the last stage (block 1, norm, the head's copy of the matrix)."""
    return build_stage(build, range(0, 1), "cpu", SEED), build_stage(build, range(1, 2), "cpu", SEED)


def trained(model: Transformer, grads: dict[str, torch.Tensor], steps: int = 2) -> torch.optim.Optimizer:
    """``steps`` optimizer steps of ``model`` with the gradients ``grads`` (by name; a tied copy by its
    original's name) on every step."""
    opt = build_optimizer(model, OPTIM, torch.device("cpu"), compile=False)
    copies = model.tied_copies()
    for _ in range(steps):
        for name, p in model.named_parameters():
            p.grad = grads[copies.get(name, name)].clone()
        opt.step()
    return opt


def same(a, b) -> bool:
    """Equal entries of an optimizer state: tensors bitwise, hyperparameters by value."""
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def one_process_grads(model: Transformer) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    model.logits(model(x)).square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_copies_on_one_rank_take_the_sum_of_their_gradients():
    a, b = (torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(2))
    a.grad, b.grad = torch.full((3, 2), 1.5), torch.arange(6.0).view(3, 2)
    TiedEmbedding([a, b]).reduce_grads()
    want = 1.5 + torch.arange(6.0).view(3, 2)
    assert torch.equal(a.grad, want) and torch.equal(b.grad, want) and a.grad is not b.grad
    b.grad = None  # a copy that took no part contributes zeros
    TiedEmbedding([a, b]).reduce_grads()
    assert torch.equal(a.grad, want) and torch.equal(b.grad, want)


def test_the_heads_copy_is_grouped_as_the_embedding():
    """One process groups the tied matrix as an embedding (no weight decay by default); the last stage's
    copy must get the same decay and rate, not a matrix's."""
    ref, (_, last) = whole(), stages()
    want = next(g for g in param_groups(ref, OPTIM) if any(p is ref.embed.weight for p in g["params"]))
    copy = next(g for g in param_groups(last, OPTIM) if any(p is last.lm_head.weight for p in g["params"]))
    assert copy["name"] == want["name"] == "embedding"
    assert (copy["weight_decay"], copy["lr_mult"]) == (want["weight_decay"], want["lr_mult"]) == (0.0, 1.0)


def test_layer_decay_uses_the_whole_models_depth_on_a_stage():
    cfg = OPTIM.model_copy(update={"layer_lr_decay": 0.5})
    want = {g["name"]: g["lr_mult"] for g in param_groups(whole(), cfg)}
    for stage in stages():
        for g in param_groups(stage, cfg):
            assert g["lr_mult"] == want[g["name"]], g["name"]


def test_the_norm_counts_a_copy_once_and_clips_it():
    a, b, c = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad, b.grad, c.grad = torch.tensor([3.0, 0.0]), torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    clipper = Clipper("norm", max_norm=2.5)
    clipper.copies = frozenset({id(b)})  # b holds a's matrix
    norm = clipper.measure([[a, b, c]])
    assert norm.item() == pytest.approx(5.0)  # sqrt(3^2 + 4^2): b left out
    clipper.clip([[a, b, c]], norm)
    # 3 x 2.5 / (5 + 1e-6) in FP32: the clip's 1e-6 and one rounding, 2.4e-7 relative measured
    assert torch.allclose(b.grad, a.grad) and a.grad[0].item() == pytest.approx(1.5, rel=1e-5)


def test_stage_checkpoints_hold_the_one_process_keys_and_values():
    """Two stages stepped with the one-process gradients (the copies' sum is the tied gradient) write
    exactly one process's optimizer entries between them: the head's copy under ``embed.weight``, with
    the same values; and read them back into the copy."""
    ref = whole()
    grads = one_process_grads(ref)
    want = optimizer_state(ref, trained(ref, grads))
    first, last = stages()
    got = [optimizer_state(m, trained(m, grads)) for m in (first, last)]
    assert not any(k.startswith(("state.lm_head.", "param_groups.lm_head.")) for k in want)
    assert set(got[0]) | set(got[1]) == set(want)
    assert "state.embed.weight.exp_avg" in got[1]  # the last stage writes the matrix's state too
    for part in got:
        for key, value in part.items():
            assert same(value, want[key]), key
    fresh = stages()[1]
    opt = build_optimizer(fresh, OPTIM, torch.device("cpu"), compile=False)
    template = optimizer_state(fresh, opt, template=True)
    assert set(template) == set(got[1])
    load_optimizer_state(fresh, opt, {k: want[k] for k in template})
    state = opt.state[fresh.lm_head.weight]
    assert torch.equal(state["exp_avg"], want["state.embed.weight.exp_avg"])
    assert torch.equal(state["exp_avg_sq"], want["state.embed.weight.exp_avg_sq"])


def test_two_copies_on_one_rank_save_once_and_load_apart():
    """A rank whose two stages keep a copy each (``rank_model`` holds both): one entry per key as one
    process writes, read back into both copies without shared storage (each steps its own state)."""
    ref = whole()
    grads = one_process_grads(ref)
    want = optimizer_state(ref, trained(ref, grads))
    owner = rank_model(list(stages()))
    assert owner.tied_copies() == {"lm_head.weight": "embed.weight"}
    opt = trained(owner, grads)
    got = optimizer_state(owner, opt)
    assert set(got) == set(want)
    for key, value in got.items():
        assert same(value, want[key]), key
    load_optimizer_state(owner, opt, want)
    emb, head = opt.state[owner.embed.weight], opt.state[owner.lm_head.weight]
    assert torch.equal(emb["exp_avg"], head["exp_avg"])
    assert emb["exp_avg"].data_ptr() != head["exp_avg"].data_ptr()
