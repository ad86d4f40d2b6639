"""Planted bugs the suite must catch: each is applied to a clean worktree of a revision, the tests named
for it are run, and the bug counts as caught only if they fail (and pass without it).

    .venv/bin/python .ci/mutants.py [REV [NAME ...]]     (default HEAD and every bug; exit 1 if one is missed)

The tests run with this checkout's virtual environment and the worktree's sources first on the path
(PYTHONPATH), so a revision before or after a change of the suite is checked the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALL = ["-m", "slow or distributed or not slow"]  # node ids of any set

# name: (file, text, replacement, tests that must fail)
MUTANTS = {
    # the gradient averaged over dp * (1 + 2**-23) instead of dp: one ulp of FP32 (issue "any CPU")
    "gradient scale one ulp off": (
        "src/lmforge/train/modules.py",
        "precision.backward(objective * dp if dp != 1 else objective)",
        "precision.backward(objective * (dp / (1 + 2**-23)) if dp != 1 else objective)",
        ["tests/test_distributed.py::test_layout_matches_one_process[ddp]"],
    ),
    # the cosine decays the wrong way: the rate rises from the floor to the peak
    "cosine schedule sign": (
        "src/lmforge/optim/schedules.py",
        "0.5 * (1.0 + math.cos(math.pi * q))",
        "0.5 * (1.0 - math.cos(math.pi * q))",
        ["tests/test_schedules.py"],
    ),
    # a resumed loader starts one sequence after where the checkpoint stopped
    "resume data position off by one": (
        "src/lmforge/data/loader.py",
        'self.position = int(state["position"])',
        'self.position = int(state["position"]) + 1',
        ["tests/test_loader.py"],
    ),
    # the squared gradient norms of the pipeline stages are never summed: each stage clips by its own norm
    "missing all-reduce of the pipeline's gradient norm": (
        "src/lmforge/optim/clip.py",
        "        dist.all_reduce(squared, group=across)\n",
        "",
        ["tests/test_distributed.py::test_pipeline_matches_one_process[gpipe]"],
    ),
    # the MoE router's product computed beside its module: LoRA, QLoRA and QAT never reach it
    "router bypasses its module": (
        "src/lmforge/model/moe_routing.py",
        "return router(x.to(module_dtype(router, acc))).to(acc)",
        "return torch.nn.functional.linear(x.to(acc), router.weight.to(acc))",
        [
            "tests/test_combinations.py::test_combination_works_or_is_refused[moe+lora]",
            "tests/test_combinations.py::test_combination_works_or_is_refused[moe+qat]",
        ],
    ),
    # LoRA freezes a reward model's score head with the base: the run trains against a random projection
    "reward head frozen under LoRA": (
        "src/lmforge/model/lora.py",
        'p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTERS or name.startswith(heads))',
        'p.requires_grad_(name.rsplit(".", 1)[-1] in ADAPTERS)',
        ["tests/test_combinations.py::test_combination_works_or_is_refused[lora+reward]"],
    ),
    # RL's old log-probabilities taken from the update's own forward: the ratio is 1, no clip ever binds
    "old log-probabilities from the same forward": (
        "src/lmforge/posttrain/rl.py",
        "logp, ro.old_logp, ro.ref_logp, mask",
        "logp, logp.detach(), ro.ref_logp, mask",
        [
            "tests/test_rl_clipping.py",
            "tests/test_combinations.py::test_combination_works_or_is_refused[grpo]",
        ],
    ),
}


def run_tests(tree: Path, tests: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *ALL, *tests]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "HEAD"
    only = set(argv[1:])
    unknown = only - set(MUTANTS)
    if unknown:
        print(f"no such planted bug: {', '.join(sorted(unknown))}; names: {', '.join(MUTANTS)}")
        return 2
    missed = 0
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True
        )
        try:
            for name, (rel, text, replacement, tests) in MUTANTS.items():
                if only and name not in only:
                    continue
                path = tree / rel
                source = path.read_text()
                if source.count(text) != 1:
                    print(
                        f"{name}: {rel} at {rev} does not hold the mutated text once: not applied", flush=True
                    )
                    missed += 1
                    continue
                clean = run_tests(tree, tests)
                path.write_text(source.replace(text, replacement))
                try:
                    bad = run_tests(tree, tests)
                finally:
                    path.write_text(source)
                caught = clean.returncode == 0 and bad.returncode != 0
                missed += not caught
                last = (bad.stdout.strip().splitlines() or [""])[-1]
                print(
                    f"{name}: {'caught' if caught else 'MISSED'} by {' '.join(tests)} at {rev} "
                    f"(clean exit {clean.returncode}; mutated: {last})",
                    flush=True,
                )
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
