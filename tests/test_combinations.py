"""The combination matrix (``tests/combinations.py``): each single feature and each pair of features trains
two steps on a tiny model and passes every check, or is refused before any work in one line naming both
keys, exactly as ``REFUSED`` lists; ``docs/compatibility.md`` is that list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.posttrain.finetune import start
from lmforge.recipe import load_config
from lmforge.train.launch import train
from tests import combinations as matrix
from tests.conftest import tiny_overrides

DOCS = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"

# 2 layers of width 128 (the smallest where QLoRA's NF4 blocks of 64 x 256 values fit the linear layers:
# 128 x 128 and 128 x 384), 64 tokens (room for an RL prompt and its completion), 2 steps of 2 sequences;
# the gradient clip is set to bind at every step (a clip that must bind does)
MODEL = {"model.n_layers": 2, "model.d_model": 128, "model.n_heads": 4, "data.seq_len": 64}
RUN = {
    "train.compile": False,  # the plain values of the axes (a post-training recipe's defaults differ)
    "train.precision": "fp32",
    "train.steps": 2,
    "train.micro_batch_size": 2,
    "train.eval_interval": 0,
    "train.eval_tokens": 128,
    "train.checkpoint_interval": 0,
    "train.log_interval": 1,
    "train.sample_tokens": 0,
    "train.grad_clip": 1e-6,
    "schedule.warmup": 0,
    "optim.lr": 1e-3,
    "train.loss_scale.init_scale": 1024.0,  # fp16: no overflow-skipped step at this scale
}


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _posttrain_files(root: Path, objective: str) -> dict:
    """The records of ``objective``: SFT instructions, preference pairs (DPO, reward), RL prompts."""
    names = ["read", "write", "open", "close", "seek", "tell"]
    if objective == "sft":
        rows = [
            {"instruction": f"What does `{n}` do?", "input": "", "output": f"It will {n} it."} for n in names
        ]
    elif objective in ("dpo", "reward"):
        rows = [
            {"prompt": f"What does `{n}` do?", "chosen": f"It will {n} it.", "rejected": f"It {n}s not."}
            for n in names
        ]
    else:
        rows = [{"prompt": f"def {n}(x):"} for n in names]
        return {
            "posttrain.train_files": [_jsonl(root / "prompts.jsonl", rows)],
            "rl.reward": "tests.rl_rewards:length",
            "rl.group_size": 2,
            "rl.max_new_tokens": 4,
            "rl.reward_workers": 1,
            "train.micro_batch_size": 1,
        }
    return {"posttrain.train_files": [_jsonl(root / f"{objective}.jsonl", rows)]}


@pytest.fixture(scope="module")
def bases(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    """A pretrained run of each model kind (dense, MoE) for the post-training objectives to start from."""
    return make_bases(corpus_dir, tmp_path_factory.mktemp("bases"))


def make_bases(corpus_dir: Path, root: Path) -> dict[str, Path]:
    """One-step pretrained runs ``root / "dense"`` and ``root / "moe"`` (their data cached in ``root / "data"``)."""
    out = {}
    for kind in ("dense", "moe"):
        over = tiny_overrides(corpus_dir, root / "data") | MODEL | RUN | matrix.FEATURES[kind][1].overrides
        train(load_config(None, over | {"train.steps": 1}), root / kind, progress_bar=False)
        out[kind] = root / kind
    return out


def prepare_combo(combo: tuple[str, ...], root: Path, corpus_dir: Path, bases: dict[str, Path], cache: Path):
    """``(cfg, resume, None)`` for a run of ``combo`` in ``root / "run"`` (a post-training run is started
    from its base here: ``start`` writes its step 0), or ``(None, False, message)`` when it is refused."""
    over = matrix.overrides(combo)
    objective = matrix.objective(combo)
    try:
        if objective == "lm":
            return load_config(None, tiny_overrides(corpus_dir, cache) | MODEL | RUN | over), False, None
        kind = "rl" if objective in ("grpo", "rloo", "ppo") else objective
        post = {k: v for k, v in over.items() if not k.startswith("model.") and k != "train.objective"}
        post = RUN | _posttrain_files(root, objective) | post
        cfg, _ = start(kind, bases[matrix.model_kind(combo)], root / "run", overrides=post)
        return cfg, True, None
    except UserError as e:
        return None, False, str(e)


def run_combo(combo: tuple[str, ...], root: Path, corpus_dir: Path, bases: dict[str, Path]):
    """Train ``combo`` two steps in ``root / "run"``: ``(probe, None)``, or ``(None, message)`` when refused."""
    probe = matrix.Probe()
    run_dir = root / "run"
    cfg, resume, message = prepare_combo(combo, root, corpus_dir, bases, root / "data")
    if message is not None:
        return None, message, run_dir
    try:
        train(cfg, run_dir, resume=resume, callbacks=[probe], progress_bar=False)
    except UserError as e:
        return None, str(e), run_dir
    return probe, None, run_dir


COMBOS = matrix.pairs()


@pytest.fixture
def graph_only_compile(monkeypatch):
    """``train.compile`` traced by Dynamo and AOTAutograd (``backend="aot_eager"``) without Inductor's code
    generation: what the matrix asks of compile is that every transform is traced into the graph and the
    run trains; a cold Inductor build of each of the 17 compiled combinations would take minutes. Inductor's
    own numbers are checked by the compiled tests (test_determinism, test_compile_cache, test_fused_loss,
    test_activation_checkpointing)."""
    import torch

    from lmforge.parallel import apply

    monkeypatch.setitem(apply.COMPILE_OPTIONS, "backend", "aot_eager")
    torch._dynamo.reset()  # a graph cached from an earlier combination would count as none compiled here


@pytest.mark.parametrize("combo", COMBOS, ids=["+".join(c) for c in COMBOS])
def test_combination_works_or_is_refused(combo, corpus_dir, bases, tmp_path, graph_only_compile):
    """The combination trains and passes :func:`tests.combinations.check`, or (exactly when ``REFUSED`` says
    so) is refused before any work: one line naming both features' keys, no run folder written."""
    probe, message, run_dir = run_combo(combo, tmp_path, corpus_dir, bases)
    why = matrix.refusal(combo)
    if why is None:
        assert message is None, f"{combo} refused: {message}"
        assert matrix.check(combo, probe) == []
        return
    assert message is not None, f"{combo} trained; REFUSED says: {why}"
    assert "\n" not in message and all(k in message for k in matrix.keys(combo)), message
    assert not (run_dir / "config.toml").exists()


def test_compatibility_doc_is_the_matrix():
    """``docs/compatibility.md`` is generated from the matrix's lists (``python -m tests.combinations``)."""
    assert DOCS.read_text() == matrix.table()
