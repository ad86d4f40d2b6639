"""The planner's Mixture-of-Experts figures (``plan/``) against the real model and PyTorch's trackers:
total and active parameters against the built module, FLOPs per token against a hand count, the saved
activations of MoE blocks against ``saved_activation_bytes``, the planned peak of tiny MoE steps against
``MemTracker``, model states under expert parallelism, the all-to-all volume, and ``lmforge estimate``
on an MoE recipe."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.plan.comm import ep_volume
from lmforge.plan.flops import flops_per_token, model_flops_per_token
from lmforge.plan.memory import (
    active_param_count,
    expert_parallel,
    model_buffer_bytes,
    model_states,
    param_count,
    param_tensors,
)
from lmforge.recipe import load_config
from tests.conftest import tiny_overrides
from tests.test_activation_estimate import measure, predict, shape
from tests.test_estimate_phases import _error, _planned

MOE_CONFIGS = {
    "all-moe": dict(experts=4, top_k=2),
    "shared-first-dense": dict(experts=8, top_k=2, shared_experts=1, first_dense=1, d_expert=48),
    "every-2-top-1": dict(experts=4, top_k=1, every=2, first_dense=1, shared_experts=2),
}


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_parameters_equal_the_built_module(name):
    """Every parameter's name and shape, the total and the buffers equal the module built on the meta
    device; the active count is the total less the routed experts a token skips, counted by hand."""
    cfg = ModelConfig(n_layers=4, d_model=64, n_heads=4, moe=MOE_CONFIGS[name])
    with torch.device("meta"):
        model = Transformer(cfg, 512, 64)
    assert [(t.name, t.shape) for t in param_tensors(cfg, 512, 64)] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    assert param_count(cfg, 512, 64) == sum(p.numel() for p in model.parameters())
    assert model_buffer_bytes(cfg, 64) == sum(b.numel() * b.element_size() for b in model.buffers())
    m = cfg.moe
    f = m.d_expert or 192  # llama's default width at d = 64
    idle = 0
    for i, block in enumerate(model.blocks.values()):
        if hasattr(block.mlp, "experts"):
            idle += (m.experts - m.top_k) * 3 * 64 * f
            assert block.mlp.experts.gate_proj.shape == (m.experts, 64, f) and m.is_moe_block(i)
    assert idle > 0
    assert active_param_count(cfg, 512, 64) == sum(p.numel() for p in model.parameters()) - idle


def test_flops_per_token_from_active_parameters():
    """By hand: 4 blocks 64 wide, the first dense (MLP 192), three MoE blocks of 8 experts 48 wide, top-2,
    one shared expert; tied 512 x 64 embedding (the head's FLOPs); ``6 N + 12 L d T``."""
    cfg = ModelConfig(n_layers=4, d_model=64, n_heads=4, moe=MOE_CONFIGS["shared-first-dense"])
    attention, norms = 4 * 64 * 64, 2 * 64
    dense_mlp = 3 * 64 * 192
    moe_mlp = 8 * 64 + 2 * 3 * 64 * 48 + 3 * 64 * 48  # router, two routed experts, the shared one
    n = 512 * 64 + 4 * (attention + norms) + dense_mlp + 3 * moe_mlp + 64
    assert model_flops_per_token(cfg, 512, 64) == 6 * n + 12 * 4 * 64 * 64


def test_moe_with_every_expert_used_costs_a_dense_model_plus_its_router():
    """``E = k = 2`` experts of width 96 in every block: the dense model of MLP width 192, plus the
    router's ``6 d E`` per block."""
    moe = ModelConfig(n_layers=3, d_model=64, n_heads=4, moe=dict(experts=2, top_k=2, d_expert=96))
    dense = ModelConfig(n_layers=3, d_model=64, n_heads=4, d_ff=192)
    assert model_flops_per_token(moe, 300, 32) - model_flops_per_token(dense, 300, 32) == 3 * 6 * 64 * 2
    assert flops_per_token(1, 1, 1, 1) == 18  # the dense formula itself, 6 N + 12 L d T


@pytest.mark.parametrize("policy", ["none", "full", "every:2"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(
    "moe",
    [
        dict(experts=4, top_k=2),
        dict(experts=8, top_k=2, shared_experts=1, first_dense=1, d_expert=48, score="sigmoid",
             z_loss=0.001, aux_loss=0.01, capacity_factor=1.25),
        dict(experts=4, top_k=1, every=2, seq_aux_loss=0.01),
    ],
)  # fmt: skip
def test_moe_saved_activations_equal_what_the_objective_saves(moe, autocast, policy):
    """Exact: the planner's saved bytes of a 3-block MoE model's forward against the storages its graph
    keeps (``probes/activation_memory.py``), FP32 and BF16 autocast, three checkpointing policies."""
    sh = shape("moe", 96, 32, 2, 24, n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, moe=moe)
    assert predict(sh, policy, 2 if autocast else 4) == measure(sh, policy, autocast=autocast)


# one process: the planned peak (total - overhead) against MemTracker's over a whole training step
PEAK_CASES = {
    "fp32-top2": {"model.moe.experts": 4, "model.moe.top_k": 2, "train.loss_chunk": 32},
    "bf16-shared-first-dense": {
        "model.moe.experts": 8,
        "model.moe.top_k": 2,
        "model.moe.shared_experts": 1,
        "model.moe.first_dense": 1,
        "model.moe.d_expert": 64,
        "train.precision": "bf16",
        "train.loss_chunk": 32,
    },
    "full-checkpointing-balance-losses": {
        "model.moe.experts": 4,
        "model.moe.top_k": 2,
        "model.moe.aux_loss": 0.01,
        "model.moe.z_loss": 0.001,
        "train.activation_checkpointing": "full",
        "model.tie_embeddings": False,
    },
}


@pytest.mark.parametrize("case", list(PEAK_CASES))
def test_moe_step_peak_against_the_tracker(case, corpus_dir, tmp_path_factory):
    from lmforge.probes.step_memory import measure_step
    from lmforge.train.build import build_run

    over = tiny_overrides(corpus_dir, tmp_path_factory.mktemp("cache"))
    over |= {"data.seq_len": 64, "model.d_model": 64} | PEAK_CASES[case]
    run = build_run(load_config(None, over))
    measured = measure_step(run)
    est = _planned(over, run.data.tokenizer.vocab_size)
    error = _error(est, measured.total)
    print(f"{case}: planned against measured {error:+.2%} ({est.peak_phase})")
    report = f"{est.peak_phase}, measured {measured.total:,} {measured.categories}, planned {est.rows()}"
    assert abs(error) <= 0.05, f"error {error:+.2%}; {report}"


def test_expert_states_per_rank_under_expert_and_fully_sharded_parallelism():
    """``ep = 2`` over ZeRO-3 on 4 ranks: a rank holds 2 of the 4 experts of each MoE layer whole (FP32
    parameter, gradient, AdamW's two moments and step), the rest of the model a quarter (its FSDP2
    shard); by hand from the shapes."""
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, moe=dict(experts=4, top_k=2))
    tensors = param_tensors(cfg, 512, 64)
    mine = expert_parallel(tensors, 2)
    states = model_states(mine, "zero3", 4, 1, "adamw")
    experts = [t for t in tensors if t.expert]
    assert len(experts) == 6 and all(t.shape[0] == 4 for t in experts)
    per_expert_layer = 2 * 3 * 64 * 192  # two of the four experts, three matrices each
    dense = [t for t in tensors if not t.expert]
    dense_shard = sum(-(-t.shape[0] // 4) * t.numel // t.shape[0] for t in dense)
    assert states.params == 4 * (2 * per_expert_layer + dense_shard)
    assert states.grads == states.params
    assert states.optim == 8 * (2 * per_expert_layer + dense_shard) + 4 * len(tensors)
    # one process holds every expert: the same model states as the total parameters
    assert model_states(tensors, "none", 1, 1, "adamw").params == 4 * param_count(cfg, 512, 64)


def test_all_to_all_bytes_per_step():
    """2 MoE layers, 256 tokens per rank and step, top-2, d = 64, 4 experts, ep = 2, FP32 rows out and
    back: per layer forward ``n k d (4 + 4)`` and the counts ``8 E``, backward the rows again; half of them
    leave the rank ((ep - 1) / ep, a balanced router). Full checkpointing runs the forward's exchanges
    again."""
    rows = 256 * 2 * 64 * (4 + 4)
    assert ep_volume(2, 2, 256, 2, 64, 4, 4, 4) == 0.5 * 2 * (rows + 8 * 4 + rows)
    assert ep_volume(2, 2, 256, 2, 64, 4, 4, 4, forwards=2.0) == 0.5 * 2 * (2 * (rows + 32) + rows)
    assert ep_volume(1, 2, 256, 2, 64, 4, 4, 4) == 0.0
    # bf16 under FSDP2's mixed precision: 2-byte rows both ways; 4 ranks: three quarters leave
    assert ep_volume(4, 1, 256, 2, 64, 8, 2, 2) == 0.75 * (256 * 2 * 64 * 4 * 2 + 8 * 8)


def test_estimate_plans_an_moe_recipe_and_shows_total_and_active_parameters(estimate_command):
    flags = ["--model.moe.experts=8", "--model.moe.top_k=2", "--model.moe.first_dense=1", "--gpus", "4"]
    code, out, err = estimate_command(*flags, "--parallel.ep=2")
    assert code == 0, err
    cfg = load_config(None, {"model.moe.experts": 8, "model.moe.top_k": 2, "model.moe.first_dense": 1})
    total = param_count(cfg.model, cfg.data.vocab_size, cfg.data.seq_len)
    active = active_param_count(cfg.model, cfg.data.vocab_size, cfg.data.seq_len)
    assert active < total
    first = out.splitlines()[0]
    assert f"{total:,} parameters" in first and f"{active:,} active per token" in first, first
    assert "ep 2" in out and "expert all-to-all" in out
    code, out, err = estimate_command(*flags, "--parallel.ep=2", "--json")
    data = json.loads(out)["estimate"]
    assert code == 0 and data["n_params"] == total and data["active_params"] == active
    assert data["comm"]["ep"] > 0 and data["layout"]["ep"] == 2
    assert data["flops_per_token"] == model_flops_per_token(cfg.model, cfg.data.vocab_size, cfg.data.seq_len)
    # what the planner does not model for MoE blocks is still refused in one line
    code, out, err = estimate_command(*flags, "--train.activation_checkpointing=selective")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "train.activation_checkpointing: the memory planner does not model selective" in err


def test_model_states_under_tensor_parallelism_split_only_what_the_plan_splits():
    """``tp = 2`` (``parallel/tensor.py``): the attention, the dense MLP, the shared experts, the embedding
    and the head are halved; the norms, the routers and the routed experts stay whole on every TP rank
    (they are replicated there). Expected by name from that plan, against the planner's shapes."""
    cfg = ModelConfig(
        n_layers=2, d_model=64, n_heads=4, moe=dict(experts=4, top_k=2, shared_experts=1, first_dense=1)
    )
    tensors = param_tensors(cfg, 512, 64)
    halved = (
        "attn.",
        ".mlp.gate_proj",
        ".mlp.up_proj",
        ".mlp.down_proj",
        "mlp.shared.",
        "embed.",
        "lm_head.",
    )
    split = [t for t in tensors if any(h in t.name for h in halved)]
    whole = [t for t in tensors if t not in split]
    assert {t.name for t in whole} >= {"blocks.1.mlp.router.weight", "blocks.1.mlp.experts.gate_proj"}
    expected = sum(t.numel for t in whole) + sum(t.numel for t in split) // 2
    assert model_states(tensors, "none", 1, 2, "adamw").params == 4 * expected


def test_estimate_accepts_moe_under_pipeline_and_tensor_parallelism(estimate_command):
    args = ["--gpus=4", "--model.moe.experts=4", "--model.moe.shared_experts=1", "--parallel.tp=2"]
    code, out, err = estimate_command(*args, "--parallel.pp=2")
    assert code == 0, err
    assert "tp 2, pp 2" in out
    # an expert group the stages would cut: one line, exit 2
    code, out, err = estimate_command(
        "--gpus=2", "--model.moe.experts=4", "--parallel.ep=2", "--parallel.pp=2"
    )
    assert code == 2 and "would span pipeline stages" in err and len(err.strip().splitlines()) == 1
