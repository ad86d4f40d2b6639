"""``torch.compile``'s caches keyed by ``ATEN_CPU_CAPABILITY`` (``lmforge/__init__.py``): a kernel compiled
for one capability is never served to a process with another.

The end-to-end check compiles in three fresh processes (about 15 s each on a busy 2-core machine), so it
carries the ``slow`` marker; the default run checks the tag and that ``import lmforge`` sets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch._inductor.cpu_vec_isa as cpu_vec_isa

from lmforge import compile_cache_key_tag
from tests.torchrun import REPO

# Compiled in a child process, once for each size: a pointwise map and a reduction over float64 values
# whose results are exact (integers below 2**53), so a wrong kernel cannot pass by rounding.
CHILD = """
import json, sys, torch
import lmforge

def pointwise_and_sum(x):
    return x * 2 + 1, (x * x).sum()

results = []
for n in json.loads(sys.argv[1]):
    x = torch.arange(n, dtype=torch.float64)
    y, s = torch.compile(pointwise_and_sum, dynamic=False)(x)
    odd = torch.tensor([2 * i + 1 for i in range(n)], dtype=torch.float64)
    results.append({"wrong": int((y != odd).sum()), "sum": s.item()})
print(json.dumps({"results": results, "tag": torch.compiler.config.cache_key_tag}))
"""


def exact(n: int) -> dict:
    """No value wrong, and the sum of squares 0**2 + ... + (n-1)**2 = n (n - 1) (2n - 1) / 6."""
    return {"wrong": 0, "sum": float(n * (n - 1) * (2 * n - 1) // 6)}


def test_tag_names_the_capability_once_and_keeps_the_users():
    assert compile_cache_key_tag("", None) == ""
    assert compile_cache_key_tag("", "") == ""
    assert compile_cache_key_tag("mine", None) == "mine"
    assert compile_cache_key_tag("", "avx2") == "ATEN_CPU_CAPABILITY=avx2"
    assert compile_cache_key_tag("mine", "avx2") == "mine,ATEN_CPU_CAPABILITY=avx2"
    assert compile_cache_key_tag("mine,ATEN_CPU_CAPABILITY=avx2", "avx2") == "mine,ATEN_CPU_CAPABILITY=avx2"


def _child_env(**extra: str) -> dict[str, str]:
    """This environment without ``ATEN_CPU_CAPABILITY`` or a cache tag, lmforge from this checkout, one
    thread, and ``extra``."""
    drop = ("ATEN_CPU_CAPABILITY", "TORCH_COMPILE_CACHE_KEY_TAG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **extra}


def test_importing_lmforge_tags_the_caches_only_with_the_variable_set():
    code = "import sys, lmforge; print('torch' in sys.modules)"
    plain = subprocess.run([sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True)
    assert plain.returncode == 0 and plain.stdout.split() == ["False"], plain.stderr  # nothing imported
    env = _child_env(ATEN_CPU_CAPABILITY="avx2", TORCH_COMPILE_CACHE_KEY_TAG="mine")
    quiet = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stdout.split() == ["False"], quiet.stderr  # nor with it
    for first in ("lmforge, torch", "torch, lmforge"):  # torch imported after lmforge, and before it
        code = f"import {first}; print(torch.compiler.config.cache_key_tag)"
        tagged = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert tagged.returncode == 0, tagged.stderr
        assert tagged.stdout.split() == ["mine,ATEN_CPU_CAPABILITY=avx2"], first  # the user's tag kept


def _compile_in_child(cache_dir: str, capability: str | None, sizes: list[int]) -> dict:
    """The child's results for ``sizes``, run with ``ATEN_CPU_CAPABILITY=capability`` (None: unset) and
    inductor's caches in ``cache_dir``."""
    env = _child_env(
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    cmd = [sys.executable, "-c", CHILD, json.dumps(sizes)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (capability, done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not cpu_vec_isa.valid_vec_isa_list() or cpu_vec_isa.valid_vec_isa_list()[0].bit_width() <= 256,
    reason="the CPU's widest vector ISA is AVX2 or narrower: ATEN_CPU_CAPABILITY=avx2 picks the same width",
)
def test_kernels_cached_for_one_capability_are_not_served_to_another(tmp_path):
    """One cache folder, three processes on a CPU wider than AVX2 (AVX-512): the CPU's own ISA compiles
    the graph for 1,000 values; ``ATEN_CPU_CAPABILITY=avx2`` compiles it and the graph for 1,007; the
    CPU's own ISA that one. Sharing entries (torch 2.13 alone, measured on a 2-core AMD EPYC with
    AVX-512-BF16), the second process ran AVX-512-tiled C++ built against AVX2 (the sum 168,414,708
    instead of 332,833,500, 496 of 1,000 values wrong) and the third AVX2-tiled C++ built for AVX-512
    (the sum 339,876,591 instead of 339,875,591); each must get the exact values."""
    cache = str(tmp_path / "inductor")
    own = _compile_in_child(cache, None, [1000])
    avx2 = _compile_in_child(cache, "avx2", [1000, 1007])
    back = _compile_in_child(cache, None, [1007])
    got = {"own": own, "avx2": avx2, "back": back}
    assert got == {
        "own": {"results": [exact(1000)], "tag": ""},
        "avx2": {"results": [exact(1000), exact(1007)], "tag": "ATEN_CPU_CAPABILITY=avx2"},
        "back": {"results": [exact(1007)], "tag": ""},
    }
