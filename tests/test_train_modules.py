"""The training modules: every kind of objective behind one protocol, driven by one step that never asks
what it was given."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lmforge
from lmforge.config import ModelConfig
from lmforge.data.loader import Batch
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.clip import Clipper
from lmforge.parallel.data_parallel import GradientSync
from lmforge.parallel.pipeline import Pipeline
from lmforge.posttrain import objective_dpo, objective_reward, objective_rl, objective_sft
from lmforge.posttrain.dpo import DPOObjective, SequenceLogps
from lmforge.posttrain.dpo_data import reference_logps, stack_pairs, tokenize_pairs
from lmforge.posttrain.objective_dpo import DPOModule
from lmforge.posttrain.objective_reward import RewardModule
from lmforge.posttrain.objective_rl import RLModule
from lmforge.posttrain.reward import (
    RewardModel,
    RewardObjective,
    RewardPair,
    RewardScores,
    stack_reward_pairs,
)
from lmforge.posttrain.reward_pool import RewardPool
from lmforge.posttrain.rl import RLObjective, TokenLogps
from lmforge.posttrain.rl_data import Prompt, stack_prompts
from lmforge.precision import PrecisionPolicy
from lmforge.train import modules
from lmforge.train.modules import LanguageModelModule, PipelineModule, TrainModule
from lmforge.train.step import Action, train_step
from tests.test_dpo import SEQ, render, tiny_model, toy_pairs

SRC = Path(lmforge.__file__).parent
FP32 = PrecisionPolicy("fp32", torch.device("cpu"))
PROTOCOL = [n for n, v in vars(TrainModule).items() if callable(v) and not n.startswith("_")]


def implementations() -> set[type]:
    """Every class of ``train/modules.py`` and of the objectives' modules (``posttrain/objective_*.py``)
    that has all the protocol's methods."""
    return {
        cls
        for module in (modules, objective_sft, objective_dpo, objective_reward, objective_rl)
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and cls is not TrainModule
        and all(callable(getattr(cls, name, None)) for name in PROTOCOL)
    }


def test_the_protocol_is_what_the_step_and_callbacks_use():
    assert set(PROTOCOL) >= {"micro_batch", "forward_backward", "finish_backward", "evaluate", "state_dict"}
    assert implementations() == {LanguageModelModule, PipelineModule, DPOModule, RLModule, RewardModule}


def test_the_step_never_asks_what_it_was_given():
    tree = ast.parse((SRC / "train" / "step.py").read_text())
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & {"hasattr", "getattr", "isinstance"}


def _batch(vocab: int, seed: int, rows: int = 2, t: int = 16) -> Batch:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, t + 1), generator=g)
    return Batch(x[:, :-1], x[:, 1:], torch.zeros(rows, t, dtype=torch.long))


def _step(module: TrainModule, batches: list) -> float:
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    opt = torch.optim.SGD(module.model.parameters(), lr=0.1)
    result = train_step(module, opt, batches, 0.1, Clipper("norm", 0.0), FP32)
    assert result.action is Action.STEP and torch.isfinite(result.loss)
    moved = [n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])]
    assert moved, "the step changed no parameter"
    return float(result.loss)


def test_language_model_module_takes_a_step_and_evaluates():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=2, d_model=32, n_heads=4), 64, 16)
    model.init_weights()
    module = LanguageModelModule.of(NextTokenLoss(model))
    held = [_batch(64, 9)]
    want, n = NextTokenLoss(model)(held[0].inputs, held[0].targets)
    # the same FP32 loss through the module: measured equal; 1e-6 is 8 FP32 ulps of room
    assert module.evaluate(held, FP32)["val_loss"] == pytest.approx(float(want / n), rel=1e-6)
    loss = _step(module, [_batch(64, 1), _batch(64, 2)])
    # the same model on other tokens (near log 64 at init): measured 0.04% apart, 20% only says "same model"
    assert loss == pytest.approx(float(want / n), rel=0.2)
    assert module.inspect_forward(_batch(64, 3), FP32) and module.take_metrics() == {}
    assert set(module.state_dict()) >= {"embed.weight", "blocks.0.attn.q_proj.weight"}


def test_dpo_module_takes_a_step_and_reports_its_metrics():
    model = tiny_model(0)
    policy = SequenceLogps(model, chunk=16)
    pairs, _ = tokenize_pairs(toy_pairs(4), render, SEQ, "skip")
    ref = reference_logps(policy, pairs, SEQ, 2, FP32)
    with torch.no_grad():
        model.blocks[0].attn.o_proj.weight.mul_(1.5)  # policy != reference: a gradient to follow
    module = DPOModule(model, DPOObjective(policy, beta=0.5), GradientSync())
    batch = stack_pairs(pairs[:2], SEQ, ref=ref[:2])
    _step(module, [batch])
    assert set(module.take_metrics()) >= {"rewards/margins", "logps/chosen"}
    assert set(module.evaluate([stack_pairs(pairs[2:], SEQ, ref=ref[2:])], FP32)) >= {"val_loss"}


def test_rl_module_takes_a_step_and_reports_its_metrics():
    from lmforge.config import RLConfig

    model = tiny_model(0)
    reference = TokenLogps(tiny_model(0), chunk=16)  # the same weights: the KL starts at 0
    cfg = RLConfig(group_size=3, max_new_tokens=4, reward="tests.rl_rewards:length", reward_workers=1)
    reward = RewardPool(cfg.reward, cfg.reward_timeout, 1, 0.0)
    decode = lambda ids: "x" * (sum(ids) % 4)  # noqa: E731 - text whose length (the reward) varies
    objective = RLObjective(TokenLogps(model, chunk=16), model, cfg, reward, 0, decode, 0, 7, reference)
    module = RLModule(model, objective, GradientSync())
    batch = stack_prompts([Prompt((1, 2, 3), "a", "x:1"), Prompt((4, 5), "b", "x:2")], 0, 0)
    try:
        _step(module, [batch])
        metrics = module.take_metrics()
        assert metrics["rl/kl"] == 0.0 and metrics["rl/failed_rewards"] == 0
        assert set(metrics) >= {"rl/reward_mean", "rl/entropy", "rl/clip_fraction", "rl/response_length"}
        assert set(module.evaluate([batch], FP32)) == {"val_loss", "val_reward", "val_failed_rewards"}
        assert not module.inspect_forward(batch, FP32)
    finally:
        reward.close()


def test_rl_module_adds_the_moe_balance_losses_and_reports_the_routing():
    from lmforge.config import MoEConfig, RLConfig
    from lmforge.model.moe import take_aux_loss
    from lmforge.posttrain.rl_data import rollout_rows

    fp64 = PrecisionPolicy("fp64", torch.device("cpu"))
    # beta 0: no reference (its KL term is not what this checks)
    cfg = RLConfig(group_size=2, max_new_tokens=4, reward="tests.rl_rewards:length", reward_workers=1, beta=0)
    reward = RewardPool(cfg.reward, cfg.reward_timeout, 1, 0.0)
    decode = lambda ids: "x" * (sum(ids) % 4)  # noqa: E731 - text whose length (the reward) varies
    batch = stack_prompts([Prompt((1, 2, 3), "a", "x:1"), Prompt((4, 5), "b", "x:2")], 0, 0)

    def rl_module(aux: float) -> RLModule:  # the same weights, the Switch loss's coefficient aux
        torch.manual_seed(0)
        moe = MoEConfig(experts=4, top_k=2, d_expert=16, aux_loss=aux)
        model = Transformer(ModelConfig(n_layers=2, d_model=32, n_heads=4, moe=moe), 32, SEQ)
        model.init_weights()
        model.double()
        objective = RLObjective(TokenLogps(model, chunk=16), model, cfg, reward, 0, decode, 0, 7)
        return RLModule(model, objective, GradientSync())

    def grads(module: RLModule, steps: int = 1) -> dict[str, torch.Tensor]:
        for _ in range(steps):  # a step: the counters restart at its first micro-batch
            module.model.zero_grad()
            with module.micro_batch(0, 1):
                module.forward_backward(batch, 4, 1, fp64)  # 2 prompts of a step's 4
        return {n: p.grad.clone() for n, p in module.model.named_parameters()}

    try:
        without, module = grads(rl_module(0.0)), rl_module(0.5)
        with_aux = grads(module, steps=2)
        metrics = module.take_metrics()
        # what the balance loss should add: its gradient on the rollout rows (the same seed draws the same
        # completions from the same weights), weighted by the micro-batch's 2 prompts of the step's 4
        rows, completions, _, _ = module.objective.rollout(batch)
        inputs, _, docs = rollout_rows(rows, completions, 0)
        module.model.zero_grad()
        module.model(inputs, docs)
        (take_aux_loss(module.model) * (2 / 4)).backward()
    finally:
        reward.close()
    assert take_aux_loss(module.model) is None  # taken by the backward above, none left over
    router = "blocks.0.mlp.router.weight"
    assert module.model.get_parameter(router).grad.abs().max() > 1e-3  # a gradient to compare
    for name, p in module.model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)  # the last layer's experts: none
        # float64 but for the router (FP32 logits, scores): there the policy's and the balance loss's
        # gradients are summed in FP32 (2^-24 ~ 6e-8 relative) before reaching the float64 weights; measured
        # 1.6e-7 of each tensor's largest entry at most (3 FP32 roundings). 1e-5 of it leaves 60x room and
        # fails on a balance loss left out (a difference of the whole entry) or weighted 2 / 4 otherwise
        # (+ 1e-15: where the balance loss adds nothing, want is 0 and the difference must be 0 up to float64 rounding)
        atol = 1e-5 * float(want.abs().max()) + 1e-15
        assert torch.allclose(with_aux[name] - without[name], want, rtol=0, atol=atol), name
    # the routing counters: the last step's assignments only (top_k 2 per position of the rows)
    assert sum(metrics["moe/layer.0/load"]) == 2 * inputs.numel()
    assert metrics["moe/aux_loss"] > 0 and 1 <= metrics["moe/imbalance"] <= 4


def test_reward_module_takes_a_step_and_reports_its_metrics():
    torch.manual_seed(0)
    model = RewardModel(ModelConfig(n_layers=2, d_model=32, n_heads=4), 64, SEQ)
    pairs, _ = tokenize_pairs(toy_pairs(4), render, SEQ - 1, "skip")
    scored = [RewardPair(p, 0.0) for p in pairs]
    module = RewardModule(model, RewardObjective(RewardScores(model, pad_id=0)), GradientSync())
    _step(module, [stack_reward_pairs(scored[:2], SEQ, 0)])
    assert set(module.take_metrics()) == {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
    }
    assert set(module.evaluate([stack_reward_pairs(scored[2:], SEQ, 0)], FP32)) >= {
        "val_loss",
        "val_rewards/accuracies",
    }
    assert module.inspect_forward(stack_reward_pairs(scored[:1], SEQ, 0), FP32)


def test_pipeline_module_takes_a_step_on_one_rank(tmp_path):
    """One pipeline rank holding every stage (gloo, world 1): the schedule's step, the module's figures,
    and the same loss as the plain module on the same model."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, tie_embeddings=False)

        def build() -> Transformer:
            return Transformer(cfg, 64, 16)

        pipe = Pipeline(build, None, "gpipe", microbatches=2, seed=3)
        module = PipelineModule(pipe, pipe.models[0])
        whole = build()
        torch.manual_seed(3)
        whole.init_weights()
        batch = _batch(64, 5, rows=4)
        plain = LanguageModelModule.of(NextTokenLoss(whole))
        # the same FP32 forward cut into stages: measured equal; 1e-6 is 8 FP32 ulps of room
        assert module.evaluate([batch], FP32)["val_loss"] == pytest.approx(
            plain.evaluate([batch], FP32)["val_loss"], rel=1e-6
        )
        assert module.inspect_forward(batch, FP32) is False  # no rank runs the whole network
        _step(module, [batch])
        assert set(module.take_metrics()) == {"pp_bubble", "pp_bubble_formula"}
    finally:
        dist.destroy_process_group()
