"""The mixture-of-experts layer (``model/moe.py``): kernels against a plain loop, routing, capacity, the
balance losses against hand computations, balancing from a skewed router, the bias through a checkpoint
and a tiny MoE run end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.utils.checkpoint import checkpoint

from lmforge.config import ModelConfig, check_moe
from lmforge.errors import ConfigError
from lmforge.model.moe import MoE, after_optimizer_step, start_step, take_aux_loss
from lmforge.model.moe_balance import imbalance, router_z_loss, sequence_aux_loss, switch_aux_loss
from lmforge.model.moe_experts import GroupedExperts, grouped_mm_fits
from lmforge.model.moe_routing import expert_capacity, keep_mask, route
from lmforge.parallel.model_layout import check_model_layout
from lmforge.recipe import load_config
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import model_of, tiny_overrides

MOE = {"experts": 4, "top_k": 2, "d_expert": 8}


def plain_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate) * (x @ up)) @ down


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])
def test_experts_kernel_equals_plain_loop(kernel):
    torch.manual_seed(0)
    experts = GroupedExperts(3, 16, 8)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    counts = torch.tensor([4, 0, 5])  # an empty group; the last 2 of 11 rows belong to the last group
    x = torch.randn(11, 16, requires_grad=True)
    y = experts(x, counts, kernel)
    grad = torch.randn_like(y)
    y.backward(grad)
    got = [x.grad] + [p.grad for p in experts.parameters()]

    params = [p.detach().clone().requires_grad_() for p in experts.parameters()]
    xr = x.detach().clone().requires_grad_()
    group = [0] * 4 + [2] * 7
    ref = torch.stack([plain_expert(xr[i], *(p[g] for p in params)) for i, g in enumerate(group)])
    ref.backward(grad)
    # FP32: kernel and per-row reference sum the same 16- and 8-term products in other orders, three matmuls
    # deep: ~1e-6 on values ~1 (u = 6e-8, ~sqrt(16) u a product); 1e-5 leaves ~10x, gradients included.
    # Measured (2-core Xeon with AMX, default and AVX2-forced kernels, 1 and 2 threads): outputs 2.4e-7,
    # gradients 2.9e-6 (a 3.5x margin before rtol, less than the derivation's 10x), both kernels
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, [xr.grad] + [p.grad for p in params], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_kernel_takes_grouped_mm_only_where_it_runs():
    cpu = torch.device("cpu")
    assert grouped_mm_fits(cpu, torch.float32, 16, 8) and grouped_mm_fits(cpu, torch.bfloat16, 16, 8)
    assert not grouped_mm_fits(cpu, torch.float32, 16, 6)  # 24-byte rows: torch refuses them
    assert not grouped_mm_fits(cpu, torch.bfloat16, 16, 4)  # 8-byte rows
    assert not grouped_mm_fits(cpu, torch.float64, 16, 8)  # no float64 kernel
    with pytest.raises(RuntimeError):
        torch._grouped_mm(
            torch.randn(4, 16), torch.randn(2, 16, 6), offs=torch.tensor([2, 4], dtype=torch.int32)
        )
    torch.manual_seed(0)
    experts = GroupedExperts(2, 16, 6).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x, counts = torch.randn(5, 16, dtype=torch.float64), torch.tensor([2, 3])
    want = torch.cat(
        [
            plain_expert(x[:2], *(p[0] for p in experts.parameters())),
            plain_expert(x[2:], *(p[1] for p in experts.parameters())),
        ]
    )
    # default float64 tolerances (rtol 1e-7, atol 1e-7): the loop runs the reference's float64 ops: rounding
    torch.testing.assert_close(experts(x, counts, "auto"), want)  # float64, 6 wide: the loop


def moe_layer(kernel: str = "auto", **moe) -> MoE:
    cfg = ModelConfig(n_layers=1, d_model=16, n_heads=2, moe=MOE | moe)
    torch.manual_seed(0)
    layer = MoE(cfg, 8, kernel)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    layer.reset_buffers()
    return layer


def test_layer_equals_per_token_reference_with_both_kernels():
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    outs = {}
    for kernel in ("grouped_mm", "loop"):
        layer = moe_layer(kernel)
        outs[kernel] = layer(x)
        outs[kernel].sum().backward()
        assert layer.router.weight.grad.abs().sum() > 0 and layer.experts.gate_proj.grad.abs().sum() > 0
    # FP32, the two kernels on the same inputs: the same sums in other orders (~1e-6, as above); 10x margin
    # (measured 0 on the CPU above, both kernel paths, 1 and 2 threads)
    torch.testing.assert_close(outs["grouped_mm"], outs["loop"], atol=1e-5, rtol=1e-5)
    e = layer.experts
    with torch.no_grad():
        probs = (x.reshape(-1, 16) @ layer.router.weight.T).softmax(-1)
        ref = []
        for t, p in enumerate(probs):
            top = p.topk(2).indices  # softmax scores, not renormalised (the default for softmax)
            ref.append(
                sum(
                    p[i] * plain_expert(x.reshape(-1, 16)[t], e.gate_proj[i], e.up_proj[i], e.down_proj[i])
                    for i in top
                )
            )
    # FP32 loop against a per-token reference (2 experts weighted, summed): ~1e-6 as above; 10x margin
    # (measured 8.9e-8 default kernels, 2.4e-7 AVX2-forced, same CPU)
    torch.testing.assert_close(outs["loop"].detach().reshape(-1, 16), torch.stack(ref), atol=1e-5, rtol=1e-5)


def test_routing_top_k_and_score_normalisation():
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, -1.0]])
    soft = logits.softmax(-1)
    experts, weights = route(soft, 2, normalize=False)
    assert experts.tolist() == [[0, 2], [1, 0]]
    # default FP32 tolerances (rtol 1.3e-6, atol 1e-5): route gathers the very softmax values: rounding only
    torch.testing.assert_close(weights, torch.stack([soft[0, [0, 2]], soft[1, [1, 0]]]))
    sig = logits.sigmoid()
    experts, weights = route(sig, 2, normalize=True)
    s = 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-1.0))
    # FP32 sigmoid and normalisation against float64 math.exp: a few ulp (~2e-7 relative), inside the default
    # tolerances of FP32 assert_close (rtol 1.3e-6) and allclose (rtol 1e-5)
    torch.testing.assert_close(weights[0], torch.tensor([s[0], s[1]]) / (s[0] + s[1]))
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    # the bias changes the choice, never the weight
    experts, weights = route(soft, 1, normalize=False, bias=torch.tensor([0.0, 0.0, 10.0]))
    assert experts.tolist() == [[2], [2]]
    # default FP32 tolerances: the bias changes the choice only, the weight is the same gathered softmax value
    torch.testing.assert_close(weights[:, 0], soft[:, 2])


def test_capacity_drops_in_priority_order_and_counts_them():
    # 4 tokens, 2 experts, top-2: first choices 0, 0, 0, 1; capacity floor(0.5 * 4 * 2 / 2) = 2
    assert expert_capacity(4, 2, 2, 0.5) == 2 and expert_capacity(4, 2, 2, 0.0) == 4
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = keep_mask(experts, 2, 2)
    # expert 0 takes tokens 0, 1 (first choices); expert 1 token 3 (first), then token 0 (second)
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]

    cfg = ModelConfig(
        n_layers=1,
        d_model=8,
        n_heads=2,
        moe={"experts": 2, "top_k": 2, "capacity_factor": 0.5, "d_expert": 4},
    )
    layer = MoE(cfg, 4, "loop")
    for p in layer.experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    layer.reset_buffers()
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2, 8))
    x = torch.zeros(1, 4, 8)
    x[0, :3, 0], x[0, :3, 1], x[0, 3, 1] = 2.0, 1.0, 2.0  # tokens 0-2 prefer expert 0, token 3 expert 1
    y = layer(x)
    assert layer.sums[4].item() == 4  # dropped assignments
    assert torch.equal(y[0, 2], torch.zeros(8))  # token 2 lost both experts: only the residual carries it
    layer.eval()
    assert layer(x)[0, 2].abs().sum() > 0  # evaluation is dropless


def test_capacity_computes_only_the_experts_capacity_and_equals_the_kept_assignments():
    """Dropped assignments are not computed: with a capacity factor of 0.5 the experts take exactly
    ``E x C = T k / 2`` rows (not ``T k``), and the output equals a per-token sum over the kept
    assignments alone (the keep rule by hand: first choices by position, then second choices)."""
    layer = moe_layer("loop", capacity_factor=0.5)
    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(3))
    rows = []
    hook = layer.experts.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    y = layer(x)
    hook.remove()
    t, k, e = 8, 2, 4
    capacity = math.floor(0.5 * t * k / e)  # 2 slots each
    assert rows == [e * capacity] and e * capacity == t * k // 2
    with torch.no_grad():
        flat = x.reshape(-1, 16)
        probs = (flat @ layer.router.weight.T).softmax(-1)
        top = probs.topk(k).indices
        taken = [0] * e
        kept = set()
        for slot in range(k):  # priority: every first choice by position, then every second choice
            for tok in range(t):
                i = int(top[tok, slot])
                if taken[i] < capacity:
                    taken[i] += 1
                    kept.add((tok, i))
        ex = layer.experts
        ref = torch.stack(
            [
                sum(
                    (
                        probs[tok, i]
                        * plain_expert(flat[tok], ex.gate_proj[i], ex.up_proj[i], ex.down_proj[i])
                        for i in top[tok].tolist()
                        if (tok, i) in kept
                    ),
                    torch.zeros(16),
                )
                for tok in range(t)
            ]
        )
    assert layer.sums[4].item() == t * k - len(kept)  # dropped assignments counted
    # FP32 loop against the per-token FP32 reference: rounding of the same few products (~1e-7); 1e-5
    torch.testing.assert_close(y.detach().reshape(-1, 16), ref, atol=1e-5, rtol=1e-5)


def test_float64_layer_computes_in_float64_throughout():
    """``train.precision = "fp64"``: routing, the experts, the combination and the balance losses stay
    float64 (no FP32 cast inside the layer): the output equals a float64 per-token reference to float64
    rounding, far below FP32's (an FP32 cast anywhere gives ~1e-8)."""
    layer = moe_layer("loop", z_loss=0.01).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    assert y.dtype == torch.float64 and layer.aux_loss.dtype == torch.float64
    e = layer.experts
    with torch.no_grad():
        flat = x.reshape(-1, 16)
        probs = (flat @ layer.router.weight.T).softmax(-1)
        ref = torch.stack(
            [
                sum(
                    p[i] * plain_expert(flat[t], e.gate_proj[i], e.up_proj[i], e.down_proj[i])
                    for i in p.topk(2).indices
                )
                for t, p in enumerate(probs)
            ]
        )
    # float64 sums of the same products in other orders: ~1e-16 relative; 1e-12 leaves room, 1e4 x below FP32
    torch.testing.assert_close(y.detach().reshape(-1, 16), ref, atol=1e-12, rtol=1e-12)


def test_balance_losses_against_hand_computation():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    experts = torch.tensor([[0], [0], [1], [0]])
    # Switch: E * sum_i f_i P_i, f = (3/4, 1/4), P = (0.6, 0.4)
    assert switch_aux_loss(probs, experts, 2).item() == pytest.approx(2 * (0.75 * 0.6 + 0.25 * 0.4))
    # sequence-wise, sequences (tokens 0, 1) and (2, 3): f = E/(kS) counts
    seq1 = 2 / 2 * (2 * 0.65 + 0 * 0.35)
    seq2 = 2 / 2 * (1 * 0.55 + 1 * 0.45)
    got = sequence_aux_loss(probs.view(2, 2, 2), experts.view(2, 2, 1), 2).item()
    # pytest.approx's default rel 1e-6: an FP32 loss of a few ops against its float64 hand value (~1e-7)
    assert got == pytest.approx((seq1 + seq2) / 2)
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # the same default rel 1e-6: an fp32 logsumexp squared and averaged against the float64 hand value
    assert router_z_loss(logits).item() == pytest.approx((math.log(2) ** 2 + math.log(4) ** 2) / 2)


def test_aux_loss_reaches_the_router_and_is_taken_once():
    layer = moe_layer(aux_loss=0.5, seq_aux_loss=0.25, z_loss=0.1)
    x = torch.randn(2, 6, 16)
    layer(x)
    aux = take_aux_loss(layer)
    probs = (x.reshape(-1, 16) @ layer.router.weight.T).softmax(-1)
    experts = probs.topk(2).indices
    logits = x.reshape(-1, 16) @ layer.router.weight.T
    expected = (
        0.5 * switch_aux_loss(probs, experts, 4)
        + 0.25 * sequence_aux_loss(probs.view(2, 6, 4), experts.view(2, 6, 2), 4)
        + 0.1 * router_z_loss(logits)
    )
    # default FP32 tolerances: the same loss functions on fp32 logits recomputed here, a few ulp apart at most
    torch.testing.assert_close(aux, expected)
    aux.backward()
    assert layer.router.weight.grad.abs().sum() > 0
    assert take_aux_loss(layer) is None


def skewed_layer(**moe) -> MoE:
    """Feature 0 of every token is 1 and the router's weight on it favours expert 0: it gets ~70% of the
    score and the first choice of nearly every token."""
    layer = moe_layer("loop", experts=4, top_k=1, **moe)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[0, 0] = 3.0
    return layer


def balance(layer: MoE, steps: int, optimizer=None) -> list[float]:
    """``steps`` steps on a fixed stream of batches (8 x 64 tokens); each step's max/mean load."""
    ratios = []
    for step in range(steps):
        x = torch.randn(8, 64, 16, generator=torch.Generator().manual_seed(step))
        x[..., 0] = 1.0
        start_step(layer)
        layer(x)
        ratios.append(float(imbalance(layer.load)))
        aux = take_aux_loss(layer)
        if optimizer is not None:
            optimizer.zero_grad()
            aux.backward()
            optimizer.step()
        after_optimizer_step(layer)
    return ratios


def test_aux_loss_free_bias_balances_a_skewed_router():
    layer = skewed_layer(bias_update_rate=0.01)
    ratios = balance(layer, 100)
    # the start is skewed: max/mean measured 2.8 (docs/moe.md); 2.5 is 62% of the tokens on one of 4 experts
    assert ratios[0] > 2.5
    # balanced: 512 tokens, 128 an expert; a uniform router's spread sqrt(128 x 3/4) = 9.8 tokens puts
    # max/mean near 1.1, and 1.3 is ~4 such spreads above the mean
    first = next(i for i, r in enumerate(ratios) if r < 1.3)
    assert first <= 60  # measured: step 42 (torch 2.13, CPU)
    assert sorted(ratios[60:])[20] < 1.3  # and it stays balanced: the median of the last 40 steps
    assert layer.router.weight.grad is None  # the bias alone did it: no loss, no gradient


def test_switch_aux_loss_alone_balances_a_skewed_router():
    layer = skewed_layer(aux_loss=1.0)
    ratios = balance(layer, 100, torch.optim.Adam([layer.router.weight], lr=0.02))
    # as above: the skewed start (measured 2.8) and 1.3 for balanced
    assert ratios[0] > 2.5
    assert next(i for i, r in enumerate(ratios) if r < 1.3) <= 50  # measured: step 34
    assert sorted(ratios[60:])[20] < 1.3
    assert torch.equal(layer.expert_bias, torch.zeros(4))


def test_checkpointed_block_counts_its_routing_once():
    moe = MOE | {"aux_loss": 0.01, "seq_aux_loss": 0.01, "z_loss": 0.001}
    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, moe=moe)
    loads, grads = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = model_of(cfg, 50, 8)
        if recompute:
            for block in model.blocks.values():
                block.runner = lambda layers, *a: checkpoint(layers, *a, use_reentrant=False)
        start_step(model)
        out = model(torch.arange(16).view(2, 8) % 50).square().mean()
        (out + take_aux_loss(model)).backward()
        loads.append(model.blocks[0].mlp.load.clone())
        grads.append(model.blocks[0].mlp.router.weight.grad.clone())
        assert take_aux_loss(model) is None  # the recomputation set no second loss
    assert loads[0].sum() == 16 * 2 and torch.equal(loads[0], loads[1])
    # default FP32 tolerances: the checkpointed block recomputes the same FP32 ops (rounding at most)
    torch.testing.assert_close(grads[0], grads[1])


def test_bad_moe_settings_are_refused_before_work(tmp_path):
    with pytest.raises(ValidationError, match=r"model\.moe\.top_k"):
        ModelConfig(moe={"experts": 4, "top_k": 5})
    with pytest.raises(ValidationError, match=r"model\.arch"):
        ModelConfig(arch="gpt2", moe={"experts": 4})
    # 4 x 32 = 128 tokens, top-1, 8 experts: floor(f * 128 / 8) >= 1 exactly when f >= 8 / 128 = 0.0625
    over = {"train.micro_batch_size": 4, "data.seq_len": 32, "model.moe.experts": 8, "model.moe.top_k": 1}
    check_moe(load_config(None, over | {"model.moe.capacity_factor": 0.0625}))
    with pytest.raises(ConfigError, match=r"model.moe.capacity_factor: .* at least 0.0625"):
        check_moe(load_config(None, over | {"model.moe.capacity_factor": 0.06}))
    # a pipeline runs the micro-batch as pp_microbatches (default pp = 2) parts of 64 tokens: f >= 8 / 64
    with pytest.raises(ConfigError, match=r"model.moe.capacity_factor: .* 64 tokens .* at least 0.125"):
        check_model_layout(load_config(None, over | {"model.moe.capacity_factor": 0.0625, "parallel.pp": 2}))
    for key, value in (("train.precision", "fp8"), ("parallel.pp_schedule", "zero_bubble")):
        with pytest.raises(ConfigError, match=key):
            check_moe(load_config(None, over | {key: value, "parallel.pp": 2}))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge",
            "train",
            "--run-dir",
            str(tmp_path / "run"),
            "--model.moe.experts=1",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "model.moe.top_k" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def moe_overrides(corpus_dir, root) -> dict:
    return tiny_overrides(corpus_dir, root / "data") | {
        "model.moe.experts": 4,
        "model.moe.top_k": 2,
        "model.moe.aux_loss": 0.01,
        "model.moe.bias_update_rate": 0.001,
        "model.moe.capacity_factor": 1.25,
        "train.steps": 20,
        "train.checkpoint_interval": 10,
        "train.log_interval": 1,
        "optim.lr": 1e-2,
        "train.eval_interval": 0,
    }


def test_tiny_moe_run_learns_logs_routing_and_resumes_its_bias(corpus_dir, tmp_path):
    cfg = load_config(None, moe_overrides(corpus_dir, tmp_path))
    train(cfg, tmp_path / "straight", progress_bar=False)
    records = [json.loads(ln) for ln in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5
    last = steps[-1]
    assert len(last["moe/layer.0/load"]) == 4 and sum(last["moe/layer.0/load"]) == 4 * 32 * 2
    assert last["moe/imbalance"] >= 1 and "moe/aux_loss" in last and "moe/layer.1/dropped" in last
    # MFU from the parameters a token uses: the FLOPs per token it implies, against a count by hand (2
    # MoE blocks 32 wide, experts 128 wide, 4 of them, 2 per token, tied vocabulary: 6 N + 12 L d T)
    vocab = load_checkpoint(latest_checkpoint(tmp_path / "straight"))["model"]["embed.weight"].shape[0]
    d, f, t = 32, 128, cfg.data.seq_len
    n = vocab * d + 2 * (4 * d * d + 2 * d + 4 * d + 2 * 3 * d * f) + d
    flops = last["mfu"] * last["peak_tflops"] * 1e12 / last["tokens_per_s"]
    # float64: mfu = tokens/s x FLOPs per token / peak undone by a few float64 ops (~1e-15); rel 1e-9 is room
    assert flops == pytest.approx(6 * n + 12 * 2 * d * t, rel=1e-9)
    train(cfg, tmp_path / "resumed", progress_bar=False, callbacks=[StopAfter(10)])
    train(cfg, tmp_path / "resumed", resume=True, progress_bar=False)
    # the bias is in the model's state: the checkpoints of the straight and the resumed run hold the same
    a = load_checkpoint(latest_checkpoint(tmp_path / "straight"))["model"]
    b = load_checkpoint(latest_checkpoint(tmp_path / "resumed"))["model"]
    assert a["blocks.1.mlp.expert_bias"].abs().sum() > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", [{"parallel.dp_replicate": 2}, {"parallel.dp_shard": 2}], ids=["ddp", "zero3"]
)
def test_data_parallel_moe_run_matches_one_process(layout, corpus_dir, tmp_path):
    """Two DDP or FSDP2 ranks against one process (float64, tests/test_distributed.py's harness): the balancing
    bias moves by the load summed over the ranks, so it and every weight match one process's. Dropless
    and without the balance losses, which are per-rank batch statistics (not the whole batch's)."""
    from tests.test_distributed import _overrides, assert_same_run, launch, losses

    extra = {
        "model.moe.experts": 4,
        "model.moe.top_k": 2,
        "model.moe.d_expert": 16,
        "model.moe.bias_update_rate": 0.01,
    }
    ref = tmp_path / "one"
    train(load_config(None, _overrides(corpus_dir, tmp_path / "cache", **extra)), ref, progress_bar=False)
    run = tmp_path / "ddp"
    launch(2, run, _overrides(corpus_dir, tmp_path / "cache", **extra, **layout))
    assert_same_run(run, ref)
    for key in ("moe/layer.0/load", "moe/layer.3/load"):  # each step's load: every token counted once
        assert losses(run, key) == losses(ref, key)
    bias = load_checkpoint(latest_checkpoint(run))["model"]["blocks.0.mlp.expert_bias"]
    assert bias.abs().sum() > 0
