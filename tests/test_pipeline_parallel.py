"""Pipeline parallelism (``lmforge/parallel/pipeline.py``).

Default run: the stage cut, the bubble formula, the config checks, the stage placement, and that a stage
is initialised bit for bit as the same slice of the whole model. Marked ``distributed``: every schedule,
2 processes under torchrun, trains 3 AdamW steps of a tiny float64 Llama with document masks and matches
the single-process ``train_step`` (losses, an evaluation in between, every parameter); also with the
step's batch over two ``Pipeline.step`` calls, and with a device mesh for the group.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import ConfigError
from lmforge.model.transformer import Transformer
from lmforge.parallel.pipeline import (
    SCHEDULES,
    bubble_fraction,
    build_stage,
    check_pipeline,
    stage_ids,
    stage_layers,
    stage_owners,
)
from tests.torchrun import torchrun, worker

RTOL = 1e-10  # the equivalence runs' bound: see _check_schedules

# Tolerances: bubble_fraction is float64 arithmetic on Python numbers, compared with pytest.approx's default
# (1e-6 relative) for rounding only. The equivalence bounds of the worker's runs say where they come from
# where they are asserted.


def test_stage_layers_contiguous_and_even():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    for n in range(1, 13):
        for s in range(1, n + 1):
            cut = stage_layers(n, s)
            assert [i for r in cut for i in r] == list(range(n))
            assert max(map(len, cut)) - min(map(len, cut)) <= 1
    with pytest.raises(ValueError):
        stage_layers(3, 4)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    # pytest.approx default rel 1e-6 (here and below): float64 rounding only, see "Tolerances" at the top
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 4) == pytest.approx(0.2)
    assert bubble_fraction(4, 8, v=2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, v=2) < bubble_fraction(4, 8) < bubble_fraction(4, 4)
    with pytest.raises(ValueError):
        bubble_fraction(2, 0)


def test_stage_placement():
    assert [stage_ids(r, 2, 1, "1f1b") for r in range(2)] == [[0], [1]]
    assert [stage_ids(r, 2, 2, "interleaved_1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [stage_ids(r, 3, 2, "zbv") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    owners = stage_owners(3, 2, "zbv")
    assert sorted(owners) == list(range(6)) and owners[5] == 0 and owners[3] == 2


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"pp": 2, "schedule": "pipedream"}, "parallel.pp_schedule"),
        ({"pp": 8, "n_layers": 4}, "parallel.pp"),
        ({"pp": 2, "stages_per_rank": 2, "schedule": "interleaved_1f1b", "n_layers": 3}, "parallel.pp"),
        ({"pp": 4, "microbatches": 2, "schedule": "1f1b"}, "parallel.pp_microbatches"),
        ({"pp": 4, "microbatches": 10, "schedule": "1f1b"}, None),
        (
            {"pp": 4, "microbatches": 9, "schedule": "interleaved_1f1b", "stages_per_rank": 2, "n_layers": 8},
            "parallel.pp_microbatches",
        ),
        (
            {"pp": 4, "microbatches": 3, "schedule": "interleaved_1f1b", "stages_per_rank": 2, "n_layers": 8},
            None,
        ),
        (
            {"pp": 2, "microbatches": 5, "schedule": "zero_bubble", "stages_per_rank": 2},
            "parallel.pp_microbatches",
        ),
        ({"pp": 2, "schedule": "interleaved_1f1b"}, "parallel.pp_stages_per_rank"),
        ({"pp": 2, "schedule": "gpipe", "stages_per_rank": 2}, "parallel.pp_stages_per_rank"),
        ({"pp": 2, "schedule": "zbv", "stages_per_rank": 3, "n_layers": 6}, "parallel.pp_stages_per_rank"),
        ({"pp": 2, "microbatches": 3, "micro_batch_size": 8}, "parallel.pp_microbatches"),
        ({"pp": 0}, "parallel.pp"),
        ({"pp": 2, "microbatches": 0}, "parallel.pp_microbatches"),
        ({"pp": 2, "microbatches": 4, "micro_batch_size": 8, "schedule": "gpipe"}, None),
    ],
)
def test_check_pipeline(kwargs, key):
    args = {
        "n_layers": 4,
        "schedule": "1f1b",
        "microbatches": 4,
        "micro_batch_size": None,
        "stages_per_rank": 1,
    } | kwargs
    if key is None:
        check_pipeline(**args)
        return
    with pytest.raises(ConfigError) as err:
        check_pipeline(**args)
    message = str(err.value)
    assert message.startswith(key + ":") and "\n" not in message


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("gpt2", False), ("llama", True)])
def test_stage_init_is_the_whole_models_slice(arch, tied):
    """Each stage of a 3-stage cut holds exactly (bitwise) the whole model's parameters from the same seed,
    and together the stages hold all of them; tied, the last stage's head holds the embedding's values."""
    cfg = ModelConfig(arch=arch, n_layers=5, d_model=32, n_heads=4, tie_embeddings=tied)

    def build() -> Transformer:
        return Transformer(cfg, 64, 16)

    with torch.device("meta"):
        whole = build()
    whole.materialize("cpu")
    torch.manual_seed(7)
    whole.init_weights()
    reference = dict(whole.named_parameters(remove_duplicate=False))  # tied: the matrix under both names
    torch.manual_seed(0)  # build_stage seeds itself
    seen: list[str] = []
    for layers in stage_layers(cfg.n_layers, 3):
        stage = build_stage(build, layers, "cpu", seed=7)
        for name, p in stage.named_parameters():
            assert p.device.type == "cpu" and not p.is_meta
            assert torch.equal(p, reference[name]), name
            seen.append(name)
        if arch == "llama":
            assert torch.equal(stage.rope_cos, whole.rope_cos)
        copies = {"lm_head.weight": "embed.weight"} if tied and layers.stop == cfg.n_layers else {}
        assert stage.tied_copies() == copies  # a head held apart from its embedding
    assert whole.tied_copies() == {}
    assert sorted(seen) == sorted(reference)
    blank = build_stage(
        build, range(2, 5), "cpu", seed=None
    )  # left for a checkpoint: same names, real storage
    assert {n for n, _ in blank.named_parameters()} == {
        n for n, _ in build_stage(build, range(2, 5), "cpu", seed=7).named_parameters()
    }
    assert (
        not any(p.is_meta for p in blank.parameters()) and blank.embed is None and blank.lm_head is not None
    )


def _check_schedules(results: dict, variants: list[str]) -> None:
    assert sorted(results) == sorted(variants)
    worst = {k: max(r[k] for r in results.values()) for k in ("loss_err", "eval_err", "param_err")}
    print(
        "pipeline against one process, largest relative differences",
        {k: f"{v:.2g}" for k, v in worst.items()},
    )
    # float64 runs (pp_worker.py: the FP32 initial draws widened), so a pipeline differs from one process only
    # by summation order (micro-batch accumulation, the tied copies' sum) at float64's unit roundoff,
    # 1.1e-16, which three AdamW steps magnify where gradients are near zero. Measured on a 2-core AMD EPYC
    # with AVX-512-BF16 (no AMX), every schedule and variant (``-s`` prints it): losses 1.8e-16, eval loss 0,
    # parameters 1.6e-14 (norm of the difference over the norm). 1e-10 leaves ~6,000x. The FP32 runs this
    # replaced measured parameters 4.6e-6 apart against a 1e-5 bound: half of it, by one CPU's order.
    for name, r in results.items():
        assert r["tied_equal"] in ((True,) if "+tied" in name else (None,)), name  # copies stay equal
        assert r["covers_all_params"], name
        assert 0 <= r["loss_err"] < RTOL, (name, r)
        assert 0 <= r["eval_err"] < RTOL, (name, r)
        assert 0 <= r["param_err"] < RTOL, (name, r)
        for bubbles in r["bubbles"].values():
            assert len(bubbles) == 3 and all(0 <= measured < 1 for measured, _ in bubbles), (name, r)


@pytest.mark.distributed
def test_every_schedule_matches_single_process(tmp_path):
    """Every schedule, untied and tied (``zbv``: one rank runs both ends and they share one parameter;
    the others: a copy on each of the two ranks, gradients summed after each step)."""
    out = tmp_path / "pp.jsonl"
    variants = [*SCHEDULES, *(f"{s}+tied" for s in SCHEDULES), "gpipe+accum", "1f1b+mesh", "1f1b+accum+tied"]
    proc = torchrun(2, [worker("pp_worker.py"), str(out), *variants], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_schedules({r["schedule"]: r for r in map(json.loads, out.read_text().splitlines())}, variants)


@pytest.mark.distributed
def test_tied_embedding_over_three_stages(tmp_path):
    """Three pipeline ranks: the tied matrix's copies on ranks 0 and 2 are summed over a group of those two
    (the middle rank holds neither and takes no part)."""
    out = tmp_path / "pp3.jsonl"
    variants = ["gpipe+tied", "1f1b+tied"]
    proc = torchrun(3, [worker("pp_worker.py"), str(out), *variants], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_schedules({r["schedule"]: r for r in map(json.loads, out.read_text().splitlines())}, variants)
