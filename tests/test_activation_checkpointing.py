"""Activation checkpointing (``train.activation_checkpointing``) and the saved-activation measurement.

Every policy must compute what ``none`` computes (same loss, same gradients: recomputation runs the same
kernels on the same inputs), keep the parameter names, and keep fewer bytes alive for backward.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.cli import main
from lmforge.config import ModelConfig
from lmforge.errors import UserError
from lmforge.model.loss import NextTokenLoss
from lmforge.parallel.apply import FULL, SELECTIVE, block_runner, set_activation_checkpointing
from lmforge.probes.activation_memory import saved_activation_bytes
from lmforge.train.build import validate
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from lmforge.train.resume import fixed_reason
from tests.conftest import model_of

POLICIES = ["none", "full", "every:2", "every:3", "selective"]
B, T, D, H, L, V = 2, 64, 64, 4, 4, 512
FF = 192  # llama: 64 * ceil(8 * 64 / 3 / 64)


def _setup(n_layers: int) -> tuple:
    torch.manual_seed(0)
    model = model_of(ModelConfig(n_layers=n_layers, d_model=D, n_heads=H), V, T)
    batch = (torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T)))
    return model, NextTokenLoss(model, 0), batch


@pytest.fixture
def setup():
    return _setup(L)


def _loss_and_grads(model, objective, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss, _ = objective(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_k_checkpoints_one_block_in_k():
    assert [block_runner("every:3", i) is FULL for i in range(7)] == [1, 0, 0, 1, 0, 0, 1]
    assert all(block_runner("every:1", i) is FULL and block_runner("full", i) is FULL for i in range(4))
    assert all(
        block_runner("none", i) is None and block_runner("selective", i) is SELECTIVE for i in range(4)
    )


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_policy_gives_the_same_loss_gradients_and_names(policy, setup):
    model, objective, batch = setup
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    loss, grads = _loss_and_grads(model, objective, batch)
    set_activation_checkpointing(model, policy)
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert "blocks.0.attn.q_proj.weight" in names
    got_loss, got = _loss_and_grads(model, objective, batch)
    assert torch.equal(got_loss, loss)
    for n in names:
        assert torch.equal(got[n], grads[n]), n


def _hook_bytes(model, fn) -> int:
    """Bytes of the storages saved through ``saved_tensors_hooks``, each once, without parameters and the
    batch (what the forward did not create)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own and t.dtype.is_floating_point:
            saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(saved.values())


def test_saved_bytes_fall_and_match_the_hooks_and_the_cached_outputs(setup):
    model, objective, batch = setup
    got = {}
    for policy in POLICIES:
        set_activation_checkpointing(model, policy)
        got[policy] = saved_activation_bytes(lambda: objective(*batch))
        if policy != "selective":  # everything kept is saved through the hooks (the batch is not counted)
            assert got[policy] == _hook_bytes(model, lambda: objective(*batch)), policy
    assert got["full"] < got["every:3"] <= got["every:2"] < got["none"]
    assert got["full"] < got["selective"] < got["none"]
    # selective keeps, on top of full's block inputs, each block's matmul outputs (q, k, v, o, down: B*T*D;
    # gate, up: B*T*FF), the attention output (B*T*D) and its logsumexp (B*H*T), all FP32; hooks do not see
    # them (they live in the checkpoint frame)
    per_block = 6 * B * T * D + 2 * B * T * FF + B * H * T
    assert got["selective"] - got["full"] == L * per_block * 4
    assert _hook_bytes(model, lambda: objective(*batch)) == got["full"]


def test_saved_bytes_count_views_once_and_dtype_sizes():
    w = torch.randn(16, 16, requires_grad=True)  # made before the forward: never counted

    def fn():
        x = torch.randn(8, 16)  # saved by mm for w's gradient: 8 * 16 * 4 = 512 bytes
        h = x @ w  # 512 bytes, saved below through a view of it
        v = h.view(2, 4, 16).transpose(0, 1)
        y = torch.tanh(v) * v  # tanh's output (512) and v (h's storage, once) are saved by mul
        z = y.to(torch.bfloat16)  # BF16: 128 elements * 2 bytes, saved twice by z * z, counted once
        return (z * z).sum()

    assert saved_activation_bytes(fn) == 3 * 512 + 256


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_compiled_objective_checkpoints_like_eager(policy):
    """Two blocks, the fewest in which a recomputed block feeds another block's backward (compile time
    grows with every block traced; the policies' block choices are checked eagerly above on four). In
    float64: compiled kernels fuse and sum in their own order, which FP32 shows at the scale of its
    rounding (measured in FP32 on four blocks: gradients 1.4e-6 apart, half the 1e-4 / 1e-6 bound this test
    had, on a 2-core AMD EPYC with AVX-512-BF16, no AMX). In float64 the same orders differ by float64's
    unit roundoff (1.1e-16) times a few hundred operations: measured on four blocks loss 1.4e-16 relative,
    gradients <= 2.7e-15 absolute (largest 4.9; ATen's default and AVX2 kernels, 1 and 2 threads); on these
    two, on a 2-core Xeon with AMX, loss equal, gradients <= 2.2e-15 (largest 7.2; both kernel paths and
    thread counts). 1e-10 leaves 10^4 and still sees any wrong recomputation (an FP32-sized error is 10^4
    times over it)."""
    model, objective, batch = _setup(2)
    model.double()
    loss, grads = _loss_and_grads(model, objective, batch)
    set_activation_checkpointing(model, policy)
    torch._dynamo.reset()
    got_loss, got = _loss_and_grads(model, torch.compile(objective), batch)
    assert got_loss.dtype == torch.float64
    # bounds: see the docstring (float64 reorderings measured <= 2.7e-15; 1e-10 leaves 10^4)
    torch.testing.assert_close(got_loss, loss, rtol=1e-10, atol=0)
    for n in grads:
        # see the docstring
        torch.testing.assert_close(got[n], grads[n], rtol=1e-10, atol=1e-10)


def test_a_resume_may_change_the_policy(tiny_config, tmp_path):
    assert fixed_reason("train.activation_checkpointing") is None
    straight = train(tiny_config, tmp_path / "straight", progress_bar=False)
    run = tmp_path / "run"
    train(tiny_config, run, progress_bar=False, callbacks=[StopAfter(10)])
    cfg = tiny_config.model_copy(deep=True)
    cfg.train.activation_checkpointing = "selective"
    resumed = train(cfg, run, resume=True, progress_bar=False)
    a = load_checkpoint(latest_checkpoint(tmp_path / "straight"))["model"]
    b = load_checkpoint(latest_checkpoint(run))["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["val_loss"] == straight["val_loss"]
    assert (
        '# step 10: train.activation_checkpointing "none" -> "selective"' in (run / "config.toml").read_text()
    )
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(x["step"] for x in lines if "loss" in x) == 20


def test_activation_offload_needs_cuda(tiny_config, tmp_path, capsys, cli_logging):
    cfg = tiny_config.model_copy(deep=True)
    cfg.train.device, cfg.train.activation_offload = "cpu", True
    with pytest.raises(UserError, match=r"^train\.activation_offload: .*CUDA"):
        validate(cfg)
    with pytest.raises(SystemExit) as done:
        main(
            ["train", "--run-dir", str(tmp_path / "run"), "--train.device=cpu", "--train.activation_offload"]
        )
    assert done.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].startswith("lmforge train: error: train.activation")
    )
    assert not (tmp_path / "run").exists()
