"""LoRA and QLoRA (``[lora]``, ``model/lora.py``): only the adapters train, a resume equals the uninterrupted
run, the merged export and the PEFT adapter folder give the run's logits, QLoRA trains in less memory, and
targets that name no layer are refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.cli import main
from lmforge.evaluate.run_loading import load_run
from lmforge.hf.export import export_run
from lmforge.model.lora import LoRALinear, is_adapter_key
from lmforge.posttrain.finetune import start
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.checkpoint import latest_checkpoint, load_checkpoint
from lmforge.train.launch import train
from tests.conftest import tiny_overrides
from tests.test_posttrain_runs import HELD_OUT_FUNCS, _records
from tests.torchrun import torchrun

LORA = {"lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "all-linear"}


@pytest.fixture(scope="module")
def base(corpus_dir, tmp_path_factory) -> Path:
    """A tiny pretrained Llama run, wide enough (d_model 128) for NF4's blocks of 64 x 256 values."""
    root = tmp_path_factory.mktemp("lora-base")
    over = {
        **tiny_overrides(corpus_dir, root / "data"),
        "model.d_model": 128,
        "data.seq_len": 64,
        "train.steps": 4,
        "train.sample_tokens": 0,
        "train.eval_interval": 0,
    }
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


def _over(tmp_path: Path, steps: int = 6, **more) -> dict:
    return {
        "posttrain.train_files": [str(_records(tmp_path / "train.jsonl", 24))],
        "posttrain.val_files": [str(_records(tmp_path / "val.jsonl", 4, HELD_OUT_FUNCS))],
        "train.steps": steps,
        "train.micro_batch_size": 4,
        "train.precision": "fp32",
        "train.compile": False,
        "train.eval_interval": steps,
        "train.checkpoint_interval": 3,
        "train.log_interval": 1,
        "train.sample_tokens": 0,
        "schedule.warmup": 1,
        "optim.lr": 1e-2,
        **LORA,
        **more,
    }


def _losses(run: Path) -> list[float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def test_only_adapters_train_and_resume_equals_uninterrupted(base, tmp_path):
    over = _over(tmp_path, **{"lora.dropout": 0.1})
    cfg, step0 = start("sft", base, tmp_path / "a", overrides=over)
    first = load_checkpoint(step0)["model"]
    train(cfg, tmp_path / "a", resume=True, progress_bar=False)
    last = load_checkpoint(latest_checkpoint(tmp_path / "a"))["model"]
    adapters = [k for k in first if is_adapter_key(k)]
    assert len(adapters) == 2 * 7 * 2  # 7 linear layers a block (not the head), 2 blocks, A and B
    for k in first:  # every base tensor bitwise unchanged; every adapter moved
        assert torch.equal(first[k], last[k]) != is_adapter_key(k), k
    assert all(not first[k].any() for k in adapters if k.endswith("lora_B"))  # B = 0: starts as the base
    # resumed after 3 steps (dropout on: the RNG state is part of the checkpoint)
    cfg_b, _ = start("sft", base, tmp_path / "b", overrides=over)
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False, callbacks=[StopAfter(3)])
    train(cfg_b, tmp_path / "b", resume=True, progress_bar=False)
    resumed = load_checkpoint(latest_checkpoint(tmp_path / "b"))["model"]
    # bitwise: a resume in the same process replays the same FP32 operations in the same order (measured max
    # |diff| 0 for weights and losses, 2-core Xeon with AMX, default and AVX2-forced kernels, 1 and 2 threads)
    for k in last:
        assert torch.equal(resumed[k], last[k]), k
    assert _losses(tmp_path / "b")[-3:] == _losses(tmp_path / "a")[-3:]


def test_optimizer_holds_only_the_adapters(base, tmp_path):
    cfg, _ = start("sft", base, tmp_path / "r", overrides=_over(tmp_path))
    run = build_run(cfg, run_dir=tmp_path / "r")
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    named = dict(run.model.named_parameters())
    assert held == {id(p) for n, p in named.items() if is_adapter_key(n)}
    assert all(p.requires_grad == is_adapter_key(n) for n, p in named.items())


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids)


def test_merged_export_and_peft_adapter_give_the_runs_logits(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, _ = start("sft", base, tmp_path / "s", overrides=_over(tmp_path))
    train(cfg, tmp_path / "s", resume=True, progress_bar=False)
    _, _, model, _ = load_run(tmp_path / "s", torch.device("cpu"))
    assert any(isinstance(m, LoRALinear) for m in model.modules())
    model.eval()
    ids = torch.randint(0, cfg.data.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.logits(model(ids)).float()
    merged = AutoModelForCausalLM.from_pretrained(export_run(tmp_path / "s"), dtype=torch.float32).eval()
    gaps = {"merged": (_logits(merged, ids).logits - want).abs().max().item()}
    folder = export_run(tmp_path / "s", adapter=True)
    config = json.loads((folder / "adapter_config.json").read_text())
    hf_base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    gaps["base alone"] = (_logits(hf_base.eval(), ids).logits - want).abs().max().item()
    peft = PeftModel.from_pretrained(hf_base, folder).eval()
    gaps["peft"] = (_logits(peft, ids).logits - want).abs().max().item()
    print("largest |logit difference| against the lmforge LoRA model:", gaps)
    # FP32, no recorded figure: merged W + (alpha / r) B A against two products, and HF's layers against
    # lmforge's: sums of width 128 and more (~sqrt(128) x 6e-8 = 7e-7 relative) through 2 blocks, on
    # logits of a few units: ~1e-6; 1e-5 leaves ~10x
    assert gaps["merged"] < 1e-5 and gaps["peft"] < 1e-5
    # > 1e-3: 100x the bound above; 6 adapter steps at lr 1e-2 move the logits far more
    assert gaps["base alone"] > 1e-3  # the adapters matter: the base alone is not the run


def test_qlora_trains_in_less_memory_than_lora(base, tmp_path):
    from lmforge.probes.step_memory import measure_step

    measured = {}
    for quant in ("none", "nf4"):
        cfg, _ = start("sft", base, tmp_path / quant, overrides=_over(tmp_path, **{"lora.quantize": quant}))
        run = build_run(cfg, run_dir=tmp_path / quant)
        params = sum(t.numel() * t.element_size() for t in [*run.model.parameters(), *run.model.buffers()])
        measured[quant] = (params, measure_step(run).total)
    print("parameter + buffer bytes, step peak (LoRA, QLoRA):", measured)
    # NF4 keeps the targets' weights in 4 bits (1/8 of FP32, plus block scales), the embedding and head
    # stay FP32: 0.5 is a loose ceiling (the figures are printed, not recorded)
    assert measured["nf4"][0] < 0.5 * measured["none"][0]
    assert measured["nf4"][1] < measured["none"][1]
    over = _over(tmp_path, steps=8, **{"lora.quantize": "nf4", "train.checkpoint_interval": 8})
    cfg, _ = start("sft", base, tmp_path / "q", overrides=over)
    train(cfg, tmp_path / "q", resume=True, progress_bar=False)
    losses = _losses(tmp_path / "q")
    assert losses[-1] < losses[0] - 0.5, losses
    # resumed after 4 steps: the NF4 base comes back from the checkpoint's buffers as it was
    cfg, _ = start("sft", base, tmp_path / "q2", overrides=over)
    train(cfg, tmp_path / "q2", resume=True, progress_bar=False, callbacks=[StopAfter(4)])
    train(cfg, tmp_path / "q2", resume=True, progress_bar=False)
    # bitwise, as in the first test (measured 0 on the same CPU, kernel paths and thread counts)
    assert _losses(tmp_path / "q2")[-4:] == losses[-4:]


@pytest.mark.distributed
def test_lora_under_fsdp2_trains_as_one_process(base, tmp_path):
    """FSDP2 (2 processes, gloo) shards the frozen base with the adapters and reduces the adapters'
    gradients only; the run's losses are one process's."""
    over = _over(tmp_path, **{"train.micro_batch_size": 2, "train.tokens_per_step": 4 * 64})
    cfg, _ = start("sft", base, tmp_path / "one", overrides=over)
    train(cfg, tmp_path / "one", resume=True, progress_bar=False)
    _, step0 = start("sft", base, tmp_path / "two", overrides={**over, "parallel.dp_shard": 2})
    first = load_checkpoint(step0)["model"]
    done = torchrun(2, ["-m", "lmforge", "sft", "--resume", "--run-dir", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-4000:]
    # FP32; two ranks sum gradients in another order (see test_posttrain_distributed.py for the 1e-4)
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    last = load_checkpoint(latest_checkpoint(tmp_path / "two"))["model"]
    assert all(torch.equal(first[k], last[k]) != is_adapter_key(k) for k in first)


def test_targets_that_name_no_layer_are_refused_before_work(base, tmp_path, capsys, cli_logging):
    args = ["sft", "--from", str(base), "--run-dir", str(tmp_path / "x")]
    files = f'--posttrain.train_files=["{_records(tmp_path / "t.jsonl", 4)}"]'
    with pytest.raises(SystemExit) as out:
        main([*args, files, "--lora.rank=4", "--lora.targets=qkv_proj"])
    assert out.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.targets" in err[0] and "q_proj" in err[0], err
    assert not (tmp_path / "x").exists()


def test_dpo_with_lora_scores_against_the_frozen_base(base, tmp_path):
    """``lmforge dpo`` with adapters and ``dpo.reference = "model"``: the reference is the base alone
    (adapters dropped from the saved start), so at step 0 policy and reference agree (margin 0, loss
    log 2), and only the adapters move."""
    from tests.test_posttrain_runs import _pairs

    over = {
        **_over(tmp_path, steps=3, **{"dpo.reference": "model", "optim.lr": 1e-3}),
        "posttrain.train_files": [str(_pairs(tmp_path / "p.jsonl", 8))],
        "posttrain.val_files": [str(_pairs(tmp_path / "pv.jsonl", 4, HELD_OUT_FUNCS))],
        "train.eval_interval": 0,
    }
    cfg, step0 = start("dpo", base, tmp_path / "d", overrides=over)
    first = load_checkpoint(step0)["model"]
    train(cfg, tmp_path / "d", resume=True, progress_bar=False)
    lines = [json.loads(x) for x in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    # log 2 = 0.69314718 (0.6931472: its 7-digit rounding, 1.9e-8 off); abs 1e-6: the FP32 loss at margin 0
    # (ulp 6e-8 at 0.69), ~16 ulps
    assert steps[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and steps[0]["rewards/margins"] == 0.0
    last = load_checkpoint(latest_checkpoint(tmp_path / "d"))["model"]
    assert all(torch.equal(first[k], last[k]) != is_adapter_key(k) for k in first)


def test_moe_router_adapter_trains_and_a_quantized_router_runs():
    """LoRA with ``all-linear`` on an MoE model adapts the router, and the router's adapter receives a
    gradient (the router is called through its module); under QLoRA a router whose weight fits NF4's blocks
    (128 x 128 = 16384 values: 128 experts) is quantized and its product equals torchao's dequantized weight
    times the input (expected value from torchao, not lmforge)."""
    from torchao.quantization import to_nf4

    from lmforge.config import LoraConfig, ModelConfig
    from lmforge.model.lora import apply_lora, quantize_base
    from lmforge.model.transformer import Transformer

    cfg = ModelConfig(n_layers=1, d_model=128, n_heads=4, moe={"experts": 128, "top_k": 2, "d_expert": 16})
    torch.manual_seed(0)
    model = Transformer(cfg, 64, 16)
    model.init_weights()
    router_weight = model.blocks["0"].mlp.router.weight.detach().clone()
    names = apply_lora(model, LoraConfig(rank=4, targets="all-linear"))
    assert "blocks.0.mlp.router" in names
    router = model.blocks["0"].mlp.router
    with torch.no_grad():  # adapters on a real model are left for the initialisation plan: set them here
        for layer in (m for m in model.modules() if isinstance(m, LoRALinear)):
            layer.lora_A.normal_(0, 0.05)
            layer.lora_B.normal_(0, 0.05)  # B = 0 at the start gives A no gradient; any B shows the path
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(ids).float().square().mean().backward()
    assert router.lora_A.grad is not None and router.lora_A.grad.abs().sum() > 0
    assert router.weight.grad is None  # frozen base

    kept = quantize_base(model)
    assert "blocks.0.mlp.router" not in kept and router.weight is None
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        router.lora_B.zero_()  # the base product alone
        expected = x @ to_nf4(router_weight, 64, 256).get_original_weight().T
        got = router(x)
        model(ids)  # the whole MoE forward with the quantized router
    # the same dequantized FP32 weight times x: matmul rounding only (~1e-6); 1e-5 leaves room
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_lora_reward_model_trains_its_score_head(base, tmp_path):
    """Under LoRA a reward model's ``score`` head trains in full beside the adapters (it starts random:
    frozen, the run would fit adapters to a fixed random projection): it has a gradient and moves, while
    the base weights stay bitwise equal."""
    from tests.test_reward import TRAIN_MODULES, write_pairs

    pairs = write_pairs(tmp_path / "pairs.jsonl", TRAIN_MODULES, 0)
    over = {"posttrain.train_files": [str(pairs)], "train.steps": 2, "train.micro_batch_size": 2}
    over |= {"train.compile": False, "train.precision": "fp32", "train.eval_interval": 0} | LORA
    cfg, step0 = start("reward", base, tmp_path / "r", overrides=over)
    train(cfg, tmp_path / "r", resume=True, progress_bar=False)
    before = load_checkpoint(step0)["model"]
    after = load_checkpoint(latest_checkpoint(tmp_path / "r"))["model"]
    assert not torch.equal(before["score.weight"], after["score.weight"])
    assert all(torch.equal(before[k], after[k]) for k in after if ".lora_" not in k and k != "score.weight")
