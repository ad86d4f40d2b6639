"""Tensor parallelism (lmforge/parallel/tensor.py): config checks, and equivalence with one process.

The equivalence runs real processes (``tests/distributed/tp_worker.py`` under torchrun, gloo on CPU): a
2-rank tensor-parallel model must give the single-process loss, gradients and AdamW updates, in float64
within 1e-10 (the worker's ``TOL`` says where it comes from). One case
(Llama with GQA, RoPE, tied embeddings, document masks) runs by default; every case runs with
``-m distributed``.
"""

from __future__ import annotations

import pytest

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.parallel.tensor import check_tensor_parallel, valid_tp_sizes
from tests.torchrun import torchrun, worker

CASES = ["llama", "gpt2", "llama-untied-mup", "llama-meta", "gpt2-untied-mha", "stages"]


@pytest.mark.parametrize(
    ("model", "vocab", "seq_len", "tp", "message"),
    [
        ({}, 4096, 256, 3, "parallel.tp: 3 does not divide model.n_heads (8); use parallel.tp 2 or 4"),
        (
            {"n_kv_heads": 2},
            4096,
            256,
            4,
            "parallel.tp: 4 does not divide model.n_kv_heads (2); use parallel.tp 2",
        ),
        (
            {"d_ff": 100},
            4096,
            256,
            8,
            "parallel.tp: 8 does not divide the MLP width (100); use parallel.tp 2 or 4, "
            "or set model.d_ff to a multiple of 8",
        ),
        (
            {},
            4097,
            256,
            2,
            "data.vocab_size: the vocabulary (4097 tokens) is not divisible by parallel.tp (2); "
            "use a vocabulary of a multiple of 2 tokens such as 4098, or parallel.tp 1",
        ),
        (
            {},
            4096,
            100,
            8,
            "data.seq_len: 100 is not divisible by parallel.tp (8) (sequence parallelism splits the "
            "sequence); use a multiple of 8 such as 104, or parallel.tp 2 or 4",
        ),
        (
            {"n_heads": 7, "d_model": 224},
            4096,
            256,
            2,
            "parallel.tp: 2 does not divide model.n_heads (7); use parallel.tp 1",
        ),
        ({}, 4096, 256, 0, "parallel.tp: 0 must be at least 1"),
    ],
)
def test_check_refuses_with_one_line(model: dict, vocab: int, seq_len: int, tp: int, message: str):
    with pytest.raises(ConfigError) as err:
        check_tensor_parallel(ModelConfig(**model), vocab, seq_len, tp)
    assert str(err.value) == message


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_check_accepts_divisors(tp: int):
    cfg = ModelConfig(arch="gpt2", d_model=512, n_heads=8)  # tied embeddings (the default) are fine
    check_tensor_parallel(cfg, 4096, 256, tp)
    if tp > 1:
        assert tp in valid_tp_sizes(cfg, 4096, 256)


def test_valid_sizes_divide_every_sharded_dimension():
    # gcd(6 heads, 3 kv heads, d_ff 384, vocab 4104, seq 96) = 3
    assert valid_tp_sizes(ModelConfig(d_model=192, n_heads=6, n_kv_heads=3, d_ff=384), 4104, 96) == [3]


def run_worker(cases: list[str]) -> None:
    proc = torchrun(2, [worker("tp_worker.py"), *cases], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for case in cases:
        assert f"OK {case} loss" in proc.stdout, proc.stdout


def test_tensor_parallel_matches_single_process_llama():
    run_worker(["llama"])


@pytest.mark.distributed
def test_tensor_parallel_matches_single_process_every_case():
    run_worker(CASES)
