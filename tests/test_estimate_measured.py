"""The planner's parameter, gradient and optimizer-state bytes equal the bytes of the real tensors.

Each case builds lmforge's model and optimizer on the CPU (``build_model``'s path: meta device,
materialise, initialise; ``build_optimizer``), takes one optimizer step (states are created lazily on
the first step), and compares every byte: parameters (tied ones once), gradients, and
``optim/state_size.py::state_bytes`` (moments, step counters, 8-bit code books and scales, Adafactor's
factored rows and columns) with ``plan/memory.py::model_states`` under the ``lmforge`` accounting.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lmforge.config import ModelConfig, OptimConfig
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer
from lmforge.optim.build import build_optimizer
from lmforge.optim.state_size import state_bytes
from lmforge.plan.memory import model_states, optimizer_key, param_count, param_tensors

MODELS = {
    # GQA, tied head, no biases; 64 x 64 matrices and a 320 x 64 embedding quantise in 8 bits
    "llama-gqa-tied": (ModelConfig(arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2), 320, 32),
    # biases, LayerNorm, positions, untied head; vocab 301: the head (19,264 values) is not whole blocks
    "gpt2-untied": (
        ModelConfig(arch="gpt2", n_layers=2, d_model=64, n_heads=4, tie_embeddings=False),
        301,
        16,
    ),
    # llama with biases and an explicit MLP width: 3-D-free but odd shapes (k/v 64 x 32, 96-wide MLP)
    "llama-bias": (
        ModelConfig(arch="llama", n_layers=1, d_model=64, n_heads=2, n_kv_heads=1, d_ff=96, bias=True),
        260,
        16,
    ),
}
OPTIMS = [
    OptimConfig(name="adamw"),
    OptimConfig(name="adam"),
    OptimConfig(name="sgd"),
    OptimConfig(name="sgd", sgd={"momentum": 0.0}),
    OptimConfig(name="lion"),
    OptimConfig(name="adafactor"),
    OptimConfig(name="adamw8bit"),
    OptimConfig(name="muon"),
    # SOAP: factors and bases on both sides of every matrix; then with sides over 300 left out (the 320 and
    # 301-row embeddings and the untied head one-sided, the 260-row one both sides)
    OptimConfig(name="soap"),
    OptimConfig(name="soap", soap={"max_precond_dim": 300}),
]


def _key(o: OptimConfig) -> str:
    return optimizer_key(o.name, o.sgd.momentum, o.soap.max_precond_dim)


def _stepped(cfg: ModelConfig, vocab: int, seq: int, optim: OptimConfig):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg, vocab, seq)
    model.materialize("cpu")
    model.init_weights()
    opt = build_optimizer(model, optim, torch.device("cpu"), compile=False)
    x = torch.randint(0, vocab, (2, seq))
    loss, n = NextTokenLoss(model, chunk=8)(x, x)
    (loss / n).backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("optim", OPTIMS, ids=_key)
@pytest.mark.parametrize("name", list(MODELS))
def test_state_bytes_equal_the_real_tensors(name: str, optim: OptimConfig):
    cfg, vocab, seq = MODELS[name]
    if optim.name == "soap":  # eigh and QR of the factors: with 2 threads ~50x slower on a loaded 2-core CPU
        torch.set_num_threads(1)  # (conftest resets it)
    model, opt = _stepped(cfg, vocab, seq, optim)
    params = list(model.parameters())  # tied weights once
    planned = model_states(param_tensors(cfg, vocab, seq), "none", 1, 1, _key(optim))
    assert planned.params == sum(p.numel() * p.element_size() for p in params)
    assert planned.grads == sum(p.grad.numel() * p.grad.element_size() for p in params)
    assert planned.master == 0
    assert planned.optim == state_bytes(opt)
    assert param_count(cfg, vocab, seq) == sum(p.numel() for p in params)


def test_8bit_states_are_quantised_where_the_planner_says():
    """The 8-bit case is not vacuous: some moments are 8-bit (codes + scales + code book), some FP32."""
    cfg, vocab, seq = MODELS["gpt2-untied"]
    _, opt = _stepped(cfg, vocab, seq, OptimConfig(name="adamw8bit"))
    kinds = {type(s["exp_avg"]).__name__ for s in opt.state.values()}
    assert kinds == {"OptimState8bit", "Tensor"}


@pytest.mark.distributed
def test_sharded_state_bytes_equal_the_real_tensors_on_every_layout(tmp_path):
    """Two real processes (``tests/distributed/plan_worker.py``): under ZeRO-1 (DDP +
    ZeroRedundancyOptimizer's whole-tensor partition), ZeRO-2 and ZeRO-3 (FSDP2, uneven shards of a
    301-row embedding, 8-bit moments of shards, Adafactor's whole-matrix statistics, Muon's routes, SOAP's
    whole factors and bases beside sharded moments), the largest rank's parameter, gradient and
    optimizer-state bytes are the planner's, exactly."""
    from tests.distributed.plan_worker import CASES, SEQ
    from tests.torchrun import torchrun, worker

    out = tmp_path / "plan.json"
    proc = torchrun(2, [worker("plan_worker.py"), "--out", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    measured = json.loads(out.read_text())
    for name, (cfg, vocab, optim) in CASES.items():
        for layout, ranks in measured[name].items():
            planned = model_states(param_tensors(cfg, vocab, SEQ), layout, 2, 1, optim)
            largest = {k: max(r[k] for r in ranks) for k in ("params", "grads", "optim")}
            assert largest == {"params": planned.params, "grads": planned.grads, "optim": planned.optim}, (
                name,
                layout,
            )


@pytest.mark.parametrize("policy", ["none", "full", "every:2", "selective"])
@pytest.mark.parametrize(
    ("arch", "precision"), [("llama", "fp32"), ("gpt2", "bf16"), ("llama", "fp8"), ("gpt2", "fp8")]
)
def test_estimate_activations_equal_what_lmforge_objective_saves(arch: str, precision: str, policy: str):
    """FP8: the blocks' float8 layers take their FP32 weights (no autocast copies; the plan counted
    them before).
    The estimate's activations row (saved part, without the backward's recomputation) equals the bytes
    lmforge's own training objective keeps for backward, built from the same recipe as ``lmforge train``
    builds it (``training_module``: the model and loss through the transformations), measured by
    ``probes/activation_memory.py``: the wiring of recipe -> workload -> layout -> activation formula,
    including autocast's weight copies under bf16, GQA and the document mask."""
    from lmforge.plan import hardware
    from lmforge.plan.activations import attention_kind
    from lmforge.plan.estimate import estimate, layout_from_config, workload_from_config
    from lmforge.precision import PrecisionPolicy
    from lmforge.probes.activation_memory import saved_activation_bytes
    from lmforge.recipe import load_config
    from lmforge.train.build import training_module

    over = {
        "model.arch": arch,
        "model.n_layers": 3,
        "model.d_model": 64,
        "model.n_heads": 4,
        "model.tie_embeddings": arch == "gpt2",
        "data.vocab_size": 300,
        "data.seq_len": 32,
        "train.micro_batch_size": 2,
        "train.loss_chunk": 16,
        "train.compile": False,
        "train.precision": precision,
        "train.activation_checkpointing": policy,
    }
    if arch == "llama":
        over["model.n_kv_heads"] = 2
    cfg = load_config(None, over)
    cpu = torch.device("cpu")
    objective = training_module(cfg, 300, cpu).train_fn
    policy_obj = PrecisionPolicy(precision, cpu)
    x = torch.randint(0, 300, (2, 32))
    docs = torch.zeros(2, 32, dtype=torch.long)
    docs[:, 16:] = 1  # two documents per sequence: the document mask is in play

    def forward():
        with policy_obj.autocast():
            return objective(x, x, docs)

    measured = saved_activation_bytes(forward)
    workload = workload_from_config(
        cfg, precision, attention_kind("cpu", cfg.train.attention, cfg.model.doc_mask), "cpu"
    )
    hw = hardware.cpu(1e11)  # only memory is compared; FP8 is emulated on a CPU, a placeholder peak
    hw = dataclasses.replace(hw, peak_flops=hw.peak_flops | {"fp8": 1e11})
    e = estimate(workload, layout_from_config(cfg, 1), hw)
    transient = max(e.activation_parts["recompute"], e.activation_parts["forward_casts"])
    assert e.activations - transient == measured


@pytest.mark.parametrize("name", list(MODELS))
def test_buffers_are_the_models_buffers(name: str):
    """The estimate's parameters row holds the parameters and the model's buffers (Llama's RoPE tables),
    byte for byte as the built model holds them."""
    from lmforge.plan.memory import model_buffer_bytes

    cfg, vocab, seq = MODELS[name]
    with torch.device("meta"):
        model = Transformer(cfg, vocab, seq)
    model.materialize("cpu")
    assert model_buffer_bytes(cfg, seq) == sum(b.numel() * b.element_size() for b in model.buffers())
    assert any(True for _ in model.buffers()) == (cfg.arch == "llama")
