"""Detail records: attention entropy, per-part norms, update ratio, activation RMS, when records appear."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.model.attention import apply_rope, document_causal_mask
from lmforge.model.loss import NextTokenLoss
from lmforge.recipe import load_config
from lmforge.train.build import build_run
from lmforge.train.callbacks import Callback
from lmforge.train.callbacks.control import StopAfter
from lmforge.train.callbacks.detail import (
    KINDS,
    DetailMetrics,
    attention_entropy,
    group_by_part,
    is_detail_step,
    param_kind,
    part_keys,
    part_norms,
    rms,
)
from lmforge.train.launch import train
from lmforge.train.step import Action
from lmforge.train.trainer import Trainer
from tests.conftest import model_of

CPU = torch.device("cpu")


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _with(cfg, **over):
    """``cfg`` with dotted overrides ``section__key=value``."""
    for dotted, value in over.items():
        section, key = dotted.split("__")
        cfg = cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={key: value})})
    return cfg


# -- attention entropy -------------------------------------------------------------------------------


def test_equal_scores_give_log_of_the_allowed_keys():
    t, d = 12, 8
    q, k = torch.zeros(4, t, d), torch.randn(2, t, d)  # q = 0: every allowed key scores the same; GQA 4/2
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    ent = attention_entropy(q, k, causal, max_elements=t * 3)  # chunks of 3 rows
    want = torch.log(torch.arange(1, t + 1, dtype=torch.float32)).expand(4, t)
    # FP32's default bound (1.3e-6 relative + 1e-5): a softmax of <= 12 equal scores, measured 2.4e-7 apart
    torch.testing.assert_close(ent, want)


def test_document_mask_rows_see_only_their_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])
    allowed = document_causal_mask(docs)[0, 0]
    ent = attention_entropy(torch.zeros(2, 10, 4), torch.randn(2, 10, 4), allowed)
    seen = [
        1,
        2,
        3,
        1,
        2,
        1,
        2,
        3,
        4,
        1,
    ]  # keys each query may see: itself and earlier tokens of its document
    # FP32's default bound; equal scores over <= 4 keys measured bitwise equal
    torch.testing.assert_close(ent, torch.log(torch.tensor(seen, dtype=torch.float32)).expand(2, 10))


def test_entropy_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    h, t, d, scale = 3, 9, 4, 0.7
    q, k = torch.randn(h, t, d, generator=g), torch.randn(h, t, d, generator=g)
    allowed = document_causal_mask(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]]))[0, 0]
    ent = attention_entropy(q, k, allowed, scale, max_elements=20)
    for head in range(h):
        for i in range(t):
            keys = [j for j in range(t) if allowed[i, j]]
            s = [scale * float(q[head, i] @ k[head, j]) for j in keys]
            z = sum(math.exp(x) for x in s)
            p = [math.exp(x) / z for x in s]
            # FP32 entropies of <= 9 keys against float64: a few u (6e-8) each, measured 2.7e-7; 1e-5 is 40x
            assert math.isclose(float(ent[head, i]), -sum(x * math.log(x) for x in p), rel_tol=1e-5)


# -- norms per part ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_part_norms_square_sum_to_the_global_norm(arch):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, n_layers=3, d_model=32, n_heads=4, tie_embeddings=False)
    # float64, so that the one rounding left is part_norms' FP32 result: a square then carries at most 2u
    # = 1.2e-7 (u = 2^-24), and so does a sum of such squares; rel_tol 1e-5 is 80 times that. With an FP32
    # model the sums of ~30,000 squares in other orders measured 3.9e-6 here (2-core AMD EPYC with
    # AVX-512-BF16, no AMX): 39% of the bound, an order a CPU's kernels choose.
    model = model_of(cfg, 64, 16).double()
    x = torch.randint(0, 64, (2, 16))
    loss, _ = NextTokenLoss(model)(x, x)
    loss.backward()
    named = dict(model.named_parameters())
    keys = part_keys(cfg.n_layers, tied=False)
    assert keys[-1] == "head" and {param_kind(n) for n in named} == set(KINDS)
    if arch == "gpt2":
        assert param_kind("pos_embed.weight") == "embedding"
    blocks, kinds = keys[: cfg.n_layers], keys[cfg.n_layers :]
    for values in (named, {n: p.grad for n, p in named.items()}):
        whole = torch.linalg.vector_norm(torch.cat([v.flatten() for v in values.values()]))
        norms = dict(zip(keys, part_norms(group_by_part(values, keys), CPU).tolist(), strict=True))
        outside = {n: v for n, v in values.items() if not n.startswith("blocks.")}
        outside_sq = sum(float(v.detach().pow(2).sum()) for v in outside.values())
        # rel_tol 1e-5 (three asserts): see the comment at the top of this test (FP32 result of float64 sums)
        assert math.isclose(sum(norms[k] ** 2 for k in kinds), float(whole) ** 2, rel_tol=1e-5)
        assert math.isclose(sum(norms[k] ** 2 for k in blocks) + outside_sq, float(whole) ** 2, rel_tol=1e-5)
        block1 = [v for n, v in values.items() if n.startswith("blocks.1.")]
        direct = float(torch.linalg.vector_norm(torch.cat([v.flatten() for v in block1])))
        assert math.isclose(norms["block.1"], direct, rel_tol=1e-5)


# -- a run -------------------------------------------------------------------------------------------


class _Witness(Callback):
    """Copies what the hand computations need, by plain tensor operations: the gradients and parameters
    just before the optimizer step, the parameters after it, the learning rate and the first micro-batch."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.seen: dict[int, dict] = {}

    def on_batches(self, trainer, batches):
        self._batch = batches[0]
        return batches

    def veto(self, trainer, loss, grad_norm):
        named = dict(trainer.run.model.named_parameters())
        self._pending = {
            "grads": {n: p.grad.clone() for n, p in named.items()},
            "before": {n: p.detach().clone() for n, p in named.items()},
            "grad_norm": float(grad_norm),
            "batch": self._batch,
        }
        return Action.STEP

    def on_step_end(self, trainer, result):
        self._pending["after"] = {n: p.detach().clone() for n, p in trainer.run.model.named_parameters()}
        lr_of = {id(p): g["lr"] for g in trainer.run.optimizer.param_groups for p in g["params"]}
        self._pending["lr"] = {n: lr_of[id(p)] for n, p in trainer.run.model.named_parameters()}
        self.seen[trainer.progress.step] = self._pending

    def on_log(self, trainer, record):
        if record.get("detail"):
            self.records.append(record)


def _norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors])))


@pytest.mark.parametrize("model", [{}, {"mup": True, "mup_base_width": 16, "n_kv_heads": 2}])
def test_sgd_record_matches_hand_computations(tiny_config, model):
    cfg = tiny_config.model_copy(update={"model": tiny_config.model.model_copy(update=model)})
    cfg = _with(
        cfg,
        optim__name="sgd",
        optim__weight_decay=0.0,
        train__grad_clip=0.0,
        train__steps=6,
        metrics__detail_interval=3,
        train__precision="fp64",
    )
    cfg = _with(cfg, optim__sgd=cfg.optim.sgd.model_copy(update={"momentum": 0.0}))
    run = build_run(cfg)
    witness = _Witness()
    Trainer(run, [DetailMetrics(), witness]).fit()
    assert [r["step"] for r in witness.records] == [3, 6]
    model = run.model
    # A float64 run (train.precision = fp64): the hand computations below are float64 too, so the one
    # rounding between them and the record is the metric's own FP32 value (u = 2^-24 = 6e-8 relative, a
    # few u through a ratio or a root of a sum). Measured <= 6.6e-8 relative on a 2-core AMD EPYC with
    # AVX-512-BF16 (no AMX). rel_tol 1e-5 leaves 150x; an FP32 run's sums in other orders gave up to 9.2e-6
    # on the update ratios (a difference of nearly equal parameters), hence the fp64 run.
    for record in witness.records:
        seen = witness.seen[record["step"]]
        lr, grads, before, after = seen["lr"], seen["grads"], seen["before"], seen["after"]
        assert min(lr.values()) > 0
        # plain SGD: theta_after = theta_before - lr_p * g_p (lr_p: the parameter's group rate, muP's
        # multipliers included), so the ratio is ||lr_p * g_p|| / ||theta_before||
        update = {n: lr[n] * g for n, g in grads.items()}
        for i in range(cfg.model.n_layers):
            names = [n for n in grads if n.startswith(f"blocks.{i}.")]
            g, b = _norm(grads[n] for n in names), _norm(before[n] for n in names)
            # rel_tol 1e-5 here and below: see the comment above this loop (the metrics' FP32 rounding, a few u)
            assert math.isclose(record[f"grad_norm/block.{i}"], g, rel_tol=1e-5)
            assert math.isclose(record[f"param_norm/block.{i}"], _norm(after[n] for n in names), rel_tol=1e-5)
            want = _norm(update[n] for n in names) / b
            assert math.isclose(record[f"update_ratio/block.{i}"], want, rel_tol=1e-5)
        kinds = [k for k in KINDS if f"grad_norm/{k}" in record]
        assert kinds == ["embedding", "attention", "mlp", "norm"]  # tied head: counted as the embedding
        total = math.sqrt(sum(record[f"grad_norm/{k}"] ** 2 for k in kinds))
        assert math.isclose(total, seen["grad_norm"], rel_tol=1e-5)
        want = _norm(update.values()) / _norm(before.values())
        assert math.isclose(record["update_ratio"], want, rel_tol=1e-5)
        assert math.isclose(record["param_norm"], _norm(after.values()), rel_tol=1e-5)
        # the measuring forward: the first micro-batch through the model after the step, by hand
        batch = seen["batch"]
        with torch.no_grad():
            for n, p in model.named_parameters():  # the parameters after that step
                p.copy_(after[n])
            x = model.embed(batch.inputs)
            mask = document_causal_mask(batch.doc_ids)
            rope = (model.rope_cos[: x.shape[1]], model.rope_sin[: x.shape[1]])
            entropies = []
            for i, block in model.blocks.items():
                attn = block.attn
                h = block.attn_norm(x)
                bsz, t, _ = h.shape
                q = attn.q_proj(h).view(bsz, t, -1, attn.head_dim).transpose(1, 2)
                k = attn.k_proj(h).view(bsz, t, -1, attn.head_dim).transpose(1, 2)
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
                entropies.append(float(attention_entropy(q[0], k[0], mask[0, 0], attn.scale).mean()))
                x = block(x, rope, mask, None)
                rms_direct = float(x.pow(2).mean().sqrt())
                # the same bound: the metric's FP32 rounding of float64 figures (comment above the loop)
                assert math.isclose(record[f"act_rms/block.{i}"], rms_direct, rel_tol=1e-5)
                assert math.isclose(record[f"attn_entropy/layer.{i}"], entropies[-1], rel_tol=1e-5)
        # the layers' mean (positive terms, no cancellation): the FP32 roundings of a few u (6e-8); 1e-6 is ~17 u
        assert math.isclose(record["attn_entropy"], sum(entropies) / len(entropies), rel_tol=1e-6)
        assert 0 < record["attn_entropy"] < math.log(cfg.data.seq_len)
    assert all(b.attn.probe is None for b in model.blocks.values())  # the capture point is off again


def test_detail_steps():
    assert [s for s in range(1, 21) if is_detail_step(s, 5)] == [5, 10, 15, 20]
    assert not any(is_detail_step(s, 0) for s in range(1, 21))
    assert rms(torch.tensor([3.0, -4.0])) == math.sqrt(12.5)


def test_records_at_the_interval_across_a_resume_and_never_at_zero(tiny_config, tmp_path):
    cfg = _with(_with(tiny_config, metrics__detail_interval=4), train__steps=12)
    train(cfg, tmp_path / "run", progress_bar=False, callbacks=[StopAfter(6)])
    train(cfg, tmp_path / "run", resume=True, progress_bar=False)
    detail = [r for r in _records(tmp_path / "run") if r.get("detail")]
    assert [r["step"] for r in detail] == [4, 8, 12]
    assert all("act_rms/block.1" in r and "update_ratio/mlp" in r for r in detail)
    off = _with(cfg, metrics__detail_interval=0)
    train(off, tmp_path / "off", progress_bar=False)
    assert not any(r.get("detail") for r in _records(tmp_path / "off"))


# -- layouts (torchrun, gloo on CPU: ``-m distributed``) ---------------------------------------------

DETAIL_LAYOUTS = {
    "ddp": (2, {"parallel.dp_replicate": 2}),
    "zero3": (2, {"parallel.dp_shard": 2}),
    "tp": (2, {"parallel.tp": 2}),
    "1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "model.tie_embeddings": False}),
    # the tied matrix on both ends of the pipeline: its norms counted once, as the embedding's
    "1f1b_tied": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(DETAIL_LAYOUTS))
def test_layout_norms_match_one_process(name, corpus_dir, tmp_path):
    """Norms and update ratios are over the whole model whatever the layout; the measuring forward (each
    rank's own first micro-batch) runs except under tensor and pipeline parallelism."""
    from tests.test_distributed import _overrides, launch

    nproc, layout = DETAIL_LAYOUTS[name]
    cache = tmp_path / "cache"
    extra = {"metrics.detail_interval": 5, "model.tie_embeddings": layout.get("model.tie_embeddings", True)}
    train(load_config(None, _overrides(corpus_dir, cache, **extra)), tmp_path / "one", progress_bar=False)
    launch(nproc, tmp_path / name, _overrides(corpus_dir, cache, **{**extra, **layout}))
    want = [r for r in _records(tmp_path / "one") if r.get("detail")]
    got = [r for r in _records(tmp_path / name) if r.get("detail")]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [5, 10]
    # Both runs are float64 (_overrides: train.precision = fp64), so they differ by ~1e-14 (test_distributed.py
    # measures it) before each metric is rounded to FP32; two such roundings differ by at most one FP32 ulp,
    # 2^-23 = 1.2e-7 relative. Measured (2-core AMD EPYC with AVX-512-BF16, no AMX; `-s` prints it): 0 under
    # ddp, zero3 and tp, 1.1e-7 and 1.2e-7 (one ulp) under the two pipelines. 1e-6 is 8 ulps. FP32 runs
    # needed 1e-4 here: their sums in other orders differ by ~1e-6, which ten Adam steps magnify.
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        norms = [k for k in w if k.startswith(("grad_norm/", "param_norm", "update_ratio"))]
        assert len(norms) > 20 and all(k in g for k in norms)
        for key in norms:
            worst = max(worst, abs(g[key] - w[key]) / abs(w[key]) if w[key] else abs(g[key]))
            assert g[key] == pytest.approx(w[key], rel=1e-6), key
    print(f"{name}: largest relative difference of the norms and update ratios {worst:.2g}")
    assert all(("act_rms/block.0" in g) == (name in ("ddp", "zero3")) for g in got)


@pytest.mark.parametrize(("objective", "tied"), [("rl", True), ("rl", False), ("reward", True)])
def test_every_parameter_of_the_post_training_models_has_a_part(objective, tied):
    # a PPO run's value head and a reward model's score head are heads of their own, tied embedding or not:
    # the detail records (every metrics.detail_interval steps) group every parameter by part, and a PPO run
    # stopped at step 50 on the value head before
    from types import SimpleNamespace

    from lmforge.posttrain.ppo import PolicyValueModel
    from lmforge.posttrain.reward import RewardModel
    from lmforge.recipe import load_config
    from lmforge.train.callbacks.detail import DetailMetrics

    over = {"model.n_layers": 2, "model.d_model": 32, "model.n_heads": 4, "model.tie_embeddings": tied}
    cfg = load_config(None, over | {"train.objective": objective, "rl.algorithm": "ppo"})
    with torch.device("meta"):
        model = (PolicyValueModel if objective == "rl" else RewardModel)(cfg.model, 64, 16)
    named = dict(model.named_parameters())
    keys = DetailMetrics._keys(SimpleNamespace(run=SimpleNamespace(cfg=cfg)))
    groups = group_by_part(named, keys)
    head = "value_head.weight" if objective == "rl" else "score.weight"
    assert param_kind(head) == "head" and any(t is named[head] for t in groups["head"])
