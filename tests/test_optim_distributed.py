"""Every optimizer under FSDP2, ZeRO-1 and DTensor placements against one process, and through checkpoints
(real processes: ``tests/distributed/optim_worker.py`` under torchrun, gloo on CPU; see its docstring).

One launch of 2 processes checks all optimizers (model runs, checkpoints, 1-D placements); one of 4 checks
the bare optimizers on a 2 x 2 mesh (FSDP2 over tensor-parallel placements). The tests read their results.
"""

from __future__ import annotations

import json

import pytest

from tests.torchrun import torchrun, worker

pytestmark = pytest.mark.distributed

NAMES = ["adamw", "adam", "sgd", "lion", "adafactor", "adamw8bit", "muon"]
# on the 2 x 2 mesh: those with code of their own for DTensors, and torch's fused AdamW kernel (Adam and
# SGD run the same kinds of kernels as AdamW and are left out to keep the 4-process launch short)
NAMES_2D = ["adamw", "lion", "adafactor", "adamw8bit", "muon"]

# Against the reference that accumulates the ranks' shares in rank order, gradients are bitwise the
# distributed runs' (measured: every difference below is 0.0); the bound only absorbs a last-bit change.
EXACT = 1e-6
SAME_GRADIENTS = [
    "fsdp2",
    "fsdp2_state",
    "dcp_fsdp2_state",
    "dcp_fsdp2",
    "dcp_plain_state",
    "dcp_plain",
    "zero",
    "zero_resume",
    "zero_to_plain",
    "placements",
]
# Against the whole batch in one backward, gradients differ in the last bits (~1e-7). Element-wise
# optimizers stay within 1e-5 (measured <= 4.3e-6 on an AVX2 CPU). AdamW8bit does only while no moment
# rounds to the other 8-bit code: on a CPU with AVX-512 (other matmul kernels, other last bits) one did,
# and moved its element by about a code step of its block's scale: measured 6.9e-4 of the largest weight
# after three steps, so its bound is a code step's worth. Muon's Newton-Schulz runs in BF16, and one input
# value rounding the other way changes the orthogonalised update by ~1% (of BF16's 2^-8 precision), which
# three steps carry into the weights (measured 4.6e-3).
WHOLE_BATCH = {"muon": 2e-2, "adamw8bit": 3e-3}


def _launch(tmp_path_factory, nproc: int, extra: list[str], names: list[str]) -> dict:
    out = tmp_path_factory.mktemp(f"optim{nproc}") / "results.json"
    proc = torchrun(nproc, [worker("optim_worker.py"), "--out", str(out), *extra, *names], timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory, 2, [], NAMES)


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory, 4, ["--placements-only"], NAMES_2D)


def _no_errors(r: dict) -> None:
    errors = {k: v for k, v in r.items() if isinstance(v, str)}
    assert not errors, errors


@pytest.mark.parametrize("name", NAMES)
def test_fsdp2_and_zero1_step_exactly_as_one_process(results, name):
    r = results[name]
    _no_errors(r)
    for key in SAME_GRADIENTS:
        assert r[key] <= EXACT, (key, r[key], r.get("placements_each"))
    for key in ("fsdp2_whole", "zero_whole"):
        assert r[key] <= WHOLE_BATCH.get(name, 1e-5), (key, r[key])


@pytest.mark.parametrize("name", NAMES)
def test_state_layout_survives_every_layout(results, name):
    """8-bit moments stay 8-bit wherever one process keeps them so: under FSDP2 (shards of 2,048 values,
    which torchao alone would keep in FP32), ZeRO-1, and after every checkpoint load."""
    counts = results[name]["quantised"]
    assert len(set(counts.values())) == 1, counts
    assert (counts["reference"] > 0) == (name == "adamw8bit"), counts


@pytest.mark.parametrize("name", NAMES_2D)
def test_two_dimensional_placements_step_exactly(results_2d, name):
    r = results_2d[name]
    _no_errors(r)
    assert r["placements"] <= EXACT, r["placements_each"]
    assert set(r["placements_each"]) == {"S(0)/S(1)", "_S(0, 2)/S(0)", "S(0)/R"}
