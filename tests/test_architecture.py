"""The seams of the house: one build path, a plain model (meta build, init apart, cuttable into
pipeline stages), the fixed order of model transformations, resume checks on the model only."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import lmforge
from lmforge.config import Config, ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.loss import NextTokenLoss
from lmforge.model.transformer import Transformer, keep_stage
from lmforge.parallel.apply import STAGES, ApplyContext, apply
from lmforge.probes.lr_find import sweep, sweep_run
from lmforge.recipe import load_config
from lmforge.train.build import build_model, build_run
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.launch import train
from tests.conftest import model_of

V, T = 97, 16
SRC = Path(lmforge.__file__).parent


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"arch": "gpt2", "tie_embeddings": False},
        {"mup": True, "mup_base_width": 16, "n_kv_heads": 2},
    ],
)
def test_meta_build_then_init_equals_direct_build_bitwise(kw):
    cfg = Config(model=ModelConfig(n_layers=2, d_model=32, n_heads=4, **kw), data={"seq_len": T})
    on_meta = build_model(cfg, V, torch.device("cpu"))  # meta -> materialize -> seed -> init
    direct = Transformer(cfg.model, V, T)  # allocated and default-initialised on the CPU
    torch.manual_seed(cfg.train.seed)
    direct.init_weights()
    a, b = on_meta.state_dict(), direct.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name, buf in direct.named_buffers():
        assert torch.equal(buf, dict(on_meta.named_buffers())[name]), name
    if cfg.model.tie_embeddings:
        assert on_meta.lm_head.weight is on_meta.embed.weight  # re-tied after materialisation
    x = torch.randint(0, V, (2, T))
    assert torch.equal(on_meta(x), direct(x))


def test_pipeline_stages_run_their_blocks_and_compose_to_the_whole_model():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=4, d_model=32, n_heads=4, tie_embeddings=False)
    whole = model_of(cfg, V, T)
    first, last = model_of(cfg, V, T), model_of(cfg, V, T)
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    keep_stage(first, range(0, 2))
    keep_stage(last, range(2, 4))
    assert first.norm is None and first.lm_head is None and last.embed is None
    assert list(first.blocks) == ["0", "1"] and list(last.blocks) == ["2", "3"]
    # the stages' parameter names are a partition of the whole model's, unchanged
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(whole.state_dict()) and not set(first.state_dict()) & set(last.state_dict())
    x = torch.randint(0, V, (2, T))
    doc = torch.tensor([[0] * 6 + [1] * 10, [0] * T])
    hidden = first(x, doc)  # no final norm: the last block's output
    assert hidden.shape == (2, T, 32)
    middle = model_of(cfg, V, T)
    middle.load_state_dict(whole.state_dict())
    keep_stage(middle, range(1, 3))
    assert middle.embed is None and middle.lm_head is None and middle(hidden, doc).shape == (2, T, 32)
    # rtol=atol=0: the same FP32 operations on the same values in the same order: bitwise equal
    torch.testing.assert_close(last.logits(last(hidden, doc)), whole.logits(whole(x, doc)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous slice"):
        keep_stage(model_of(cfg, V, T), range(3, 5))


def test_transformations_have_one_fixed_order_and_compile_wraps_without_replacing():
    assert [name for name, _ in STAGES] == [
        "lora",
        "qat",
        "convert",
        "tensor_parallel",
        "expert_parallel",
        "activation_checkpointing",
        "compile",
        "data_parallel",
        "materialize",
    ]
    cfg = Config()
    model = model_of(ModelConfig(n_layers=1, d_model=32, n_heads=4), V, T)
    objective = NextTokenLoss(model)
    compiled = apply(objective, model, ApplyContext(cfg.train, torch.device("cpu")))
    assert compiled is not objective and compiled._orig_mod is objective  # wrapped: a compiled module
    assert "forward" not in vars(model) and "loss" not in vars(model)  # nothing replaced on the instance
    eager = apply(
        objective, model, ApplyContext(cfg.train.model_copy(update={"compile": False}), torch.device("cpu"))
    )
    assert eager is objective


def test_no_precision_strings_in_library_signatures():
    """Precision travels as one PrecisionPolicy object, never as a ``precision: str`` parameter."""
    offenders = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    if (
                        arg.arg == "precision"
                        and ast.unparse(arg.annotation or ast.Constant("")) != "PrecisionPolicy"
                    ):
                        offenders.append(f"{path.name}:{node.name}")
    assert not offenders


def test_commands_share_the_build_path():
    """train, lr-find, mup-check, eval and generate build models through train/build.py only."""
    for module in ("train/launch.py", "probes/lr_find.py", "probes/mup_check.py", "evaluate/run_loading.py"):
        text = (SRC / module).read_text()
        assert "lmforge.train.build import" in text, module
        assert "Transformer(" not in text and "PackedLoader(" not in text, module


def test_lr_find_honours_the_clip_mode(tiny_config):
    """lr-find clips as training does: its sweep equals a range test on the run ``train`` would build,
    and a different ``train.clip_mode`` gives different losses."""
    over = {"lr_find.steps": 6, "lr_find.start_lr": 1e-3, "lr_find.end_lr": 1.0, "train.grad_clip": 0.05}
    cfg = tiny_config.model_copy(update={"lr_find": tiny_config.lr_find.model_copy(update={"steps": 6})})
    group = load_config(None, {**_flat(cfg), **over, "train.clip_mode": "group_norm"})
    norm = load_config(None, {**_flat(cfg), **over, "train.clip_mode": "norm"})
    run = build_run(group)
    assert run.clipper.mode == "group_norm"
    ref = sweep_run(run, group.lr_find)
    got_group, got_norm = sweep(group), sweep(norm)
    assert got_group.losses == ref.losses
    assert got_group.losses[1:] != got_norm.losses[1:]  # step 0 is the same; clipping differs after


def _flat(cfg: Config) -> dict:
    dump = cfg.model_dump(mode="json", exclude_none=True)
    return {f"{section}.{key}": value for section, keys in dump.items() for key, value in keys.items()}


def test_resume_refuses_a_model_change_and_allows_execution_changes(tiny_config, tmp_path):
    run = tmp_path / "run"
    train(tiny_config, run, progress_bar=False, callbacks=[StopAfter(10)])
    other_model = tiny_config.model_copy(
        update={"model": tiny_config.model.model_copy(update={"n_heads": 2})}
    )
    with pytest.raises(ConfigError, match=r"model\.n_heads: the checkpoint was trained with 4, not 2"):
        train(other_model, run, resume=True, progress_bar=False)
    execution = tiny_config.train.model_copy(update={"loss_chunk": 7, "attention": "sdpa", "log_interval": 3})
    summary = train(tiny_config.model_copy(update={"train": execution}), run, resume=True, progress_bar=False)
    assert summary["step"] == tiny_config.train.steps


def test_train_signature_has_no_test_only_parameters():
    assert list(inspect.signature(train).parameters) == [
        "cfg",
        "run_dir",
        "resume",
        "callbacks",
        "progress_bar",
    ]
