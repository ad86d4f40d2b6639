"""The combination matrix: every pair of lmforge's features either works (checked) or is refused in one line.

The features are values on axes (:data:`AXES`); a combination sets one value per axis and leaves the others
at their first (plain) value. :func:`pairs` lists every single feature and every pair of features of two
different axes. :data:`REFUSED` says which combinations lmforge refuses and why: the test asserts that
exactly those are refused, before any work, in one line that names both features' keys, and that every
other combination trains and passes :func:`check` (``tests/test_combinations.py``).
``docs/compatibility.md`` is generated from these lists (``python -m tests.combinations``) and a test
compares it, so the table cannot drift from what runs.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from lmforge.train.callbacks import Callback


@dataclass(frozen=True)
class Feature:
    """One value of an axis: its recipe overrides and the config key a refusal must name."""

    name: str
    key: str  # the key the user sets (a refusal names it)
    overrides: dict = field(default_factory=dict)


MOE = {"model.moe.experts": 4, "model.moe.top_k": 2, "model.moe.d_expert": 32, "model.moe.aux_loss": 0.01}

# RL trains two updates on one step's rollouts (drawn at step 1, reused at step 2) with a clip tight enough
# that it must bind at the second: the ratio is 1 at the first update and differs from 1 at the second
RL_CYCLE = {"rl.ppo_epochs": 2, "rl.clip_epsilon": 1e-5}
RL = ("grpo", "rloo", "ppo")

AXES: dict[str, tuple[Feature, ...]] = {
    "model": (Feature("dense", "model.moe.experts"), Feature("moe", "model.moe.experts", MOE)),
    "adapter": (
        Feature("no adapter", "lora.rank"),
        Feature("lora", "lora.rank", {"lora.rank": 4, "lora.targets": "all-linear"}),
        Feature("qlora", "lora.rank", {"lora.rank": 4, "lora.targets": "all-linear", "lora.quantize": "nf4"}),
        Feature("qat", "qat.enabled", {"qat.enabled": True, "qat.group_size": 32}),
    ),
    "precision": (
        Feature("fp32", "train.precision", {"train.precision": "fp32"}),
        Feature("bf16", "train.precision", {"train.precision": "bf16"}),
        Feature("fp16", "train.precision", {"train.precision": "fp16"}),
        Feature("fp8", "train.precision", {"train.precision": "fp8"}),
    ),
    "checkpointing": (
        Feature("no checkpointing", "train.activation_checkpointing"),
        Feature(
            "checkpointing", "train.activation_checkpointing", {"train.activation_checkpointing": "full"}
        ),
    ),
    "compile": (
        Feature("eager", "train.compile"),
        Feature("compile", "train.compile", {"train.compile": True}),
    ),
    "objective": (
        Feature("lm", "train.objective"),
        Feature("sft", "train.objective", {"train.objective": "sft"}),
        Feature("dpo", "train.objective", {"train.objective": "dpo"}),
        Feature("reward", "train.objective", {"train.objective": "reward"}),
        Feature("grpo", "rl.algorithm", {"train.objective": "rl", "rl.algorithm": "grpo", **RL_CYCLE}),
        Feature("rloo", "rl.algorithm", {"train.objective": "rl", "rl.algorithm": "rloo", **RL_CYCLE}),
        Feature("ppo", "rl.algorithm", {"train.objective": "rl", "rl.algorithm": "ppo", **RL_CYCLE}),
    ),
}
# The layouts, run under torchrun in the distributed set (tests/test_combinations_distributed.py): each
# alone and with every feature above that is not its axis's plain value; two processes each. EP needs MoE.
LAYOUTS: tuple[Feature, ...] = (
    Feature("ddp", "parallel.dp_replicate", {"parallel.dp_replicate": 2}),
    Feature("fsdp", "parallel.dp_shard", {"parallel.dp_shard": 2}),
    Feature("tp", "parallel.tp", {"parallel.tp": 2}),
    Feature("pp", "parallel.pp", {"parallel.pp": 2}),
    Feature("ep", "parallel.ep", {"parallel.ep": 2, "parallel.dp_shard": 2}),
)
FEATURES = {f.name: (axis, f) for axis, values in {**AXES, "layout": LAYOUTS}.items() for f in values}

# (feature, feature) -> why lmforge refuses the pair (the refusal's one line names both keys)
REFUSED: dict[frozenset[str], str] = {
    frozenset({"moe", "fp8"}): "fp8 converts linear layers, not the experts' grouped 3-D weights",
    frozenset({"moe", "dpo"}): "DPO does not add the MoE balance losses",
    frozenset({"lora", "qat"}): "both replace the same linear layers",
    frozenset({"qlora", "qat"}): "both replace the same linear layers",
    frozenset({"qat", "fp8"}): "both replace the same linear layers",
    frozenset({"lora", "fp8"}): "both replace the same linear layers",
    frozenset({"qlora", "fp8"}): "both replace the same linear layers",
    # the layouts (distributed set)
    **{
        frozenset({x, "qlora"}): "QLoRA's NF4 weights run in one process" for x in ("ddp", "fsdp", "tp", "ep")
    },
    frozenset({"tp", "lora"}): "tensor parallelism would shard the adapters as their base layer",
    frozenset({"tp", "qat"}): "a fake-quantization group would span the tensor-parallel shards",
    frozenset(
        {"tp", "compile"}
    ): "the compiled blocks' backward fails on tensor-parallel DTensors (torch 2.13)",
    frozenset({"tp", "reward"}): "the reward head is not tensor-parallel",
    frozenset({"pp", "lora"}): "pipeline stages are not adapted",
    frozenset({"pp", "qlora"}): "pipeline stages are not adapted",
    frozenset({"pp", "fp16"}): "the pipeline schedule runs backward itself, without the loss scale",
    **{
        frozenset({"pp", o}): "the pipeline's last stage computes the next-token loss, not this objective's"
        for o in ("dpo", "reward", "grpo", "rloo", "ppo")
    },
}


def pairs() -> list[tuple[str, ...]]:
    """Every feature that is not its axis's plain value, alone, then every pair of such features of two
    different axes, in :data:`AXES` order."""
    extra = {axis: [f.name for f in values[1:]] for axis, values in AXES.items()}
    singles = [(name,) for names in extra.values() for name in names]
    doubles = [
        (a, b) for x, y in itertools.combinations(AXES, 2) for a, b in itertools.product(extra[x], extra[y])
    ]
    return singles + doubles


def layout_pairs(layout: str) -> list[tuple[str, ...]]:
    """``layout`` alone, then with each feature of :data:`AXES` that is not its axis's plain value (EP: on
    the MoE model, so ``moe`` is implied and not paired)."""
    others = [
        f.name for values in AXES.values() for f in values[1:] if not (layout == "ep" and f.name == "moe")
    ]
    return [(layout,)] + [(layout, name) for name in others]


def refused_pair(combo: tuple[str, ...]) -> tuple[str, ...] | None:
    """The pair of :data:`REFUSED` that refuses ``combo`` (an ``ep`` row also by the MoE model it implies),
    or None: it must work."""
    if len(combo) != 2:
        return None
    candidates = [combo] + [("moe", f) for f in combo if f != "ep"] * ("ep" in combo)
    return next((c for c in candidates if frozenset(c) in REFUSED), None)


def refusal(combo: tuple[str, ...]) -> str | None:
    """Why ``combo`` is refused (None: it must work)."""
    pair = refused_pair(combo)
    return REFUSED[frozenset(pair)] if pair is not None else None


def overrides(combo: tuple[str, ...]) -> dict:
    """The recipe overrides of ``combo``'s features (the plain values set none; ``ep`` brings ``moe``)."""
    out: dict = {}
    for name in ("moe", *combo) if "ep" in combo else combo:
        out |= FEATURES[name][1].overrides
    return out


def model_kind(combo: tuple[str, ...]) -> str:
    """The model ``combo`` trains: ``moe`` (asked for, or implied by ``ep``) or ``dense``."""
    return "moe" if {"moe", "ep"} & set(combo) else "dense"


def keys(combo: tuple[str, ...]) -> list[str]:
    """The config keys of ``combo``'s features (what a refusal must name)."""
    return [FEATURES[name][1].key for name in combo]


def objective(combo: tuple[str, ...]) -> str:
    """``combo``'s objective feature (``lm`` when it sets none)."""
    return next((n for n in combo if FEATURES[n][0] == "objective"), "lm")


# -- what a run must show ------------------------------------------------------------------------------


def transforms(combo: tuple[str, ...]) -> list[str]:
    """The transforms ``combo`` asks for, each counted during the run by :class:`Probe`."""
    wanted = {"lora": "lora", "qlora": "nf4", "qat": "fake_quant", "fp8": "fp8", "checkpointing": "recompute"}
    out = [wanted[n] for n in combo if n in wanted]
    if "compile" in combo:
        out.append("compiled")
    if "qlora" in combo:
        out.append("lora")
    if model_kind(combo) == "moe":
        out.append("router")
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) parameter or gradient; ``t`` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


class Probe(Callback):
    """Records what a run did: each parameter's value before training and whether it ever had a non-zero
    gradient, the calls of each kind of transformed module, and each step's clip ratio."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.wrapped: dict[str, int] = {}  # calls of each layer a wrapper replaced, by name
        self.heads: tuple[str, ...] = ()
        self.trainable: dict[str, bool] = {}
        self.had_grad: dict[str, bool] = {}
        self.calls: dict[str, int] = {}
        self.clip_ratios: list[float] = []
        self.rl_clip: list[float] = []  # RL: the share of tokens (RLOO: sequences) clipped, by step
        self.losses: list[float] = []
        self.after: dict[str, torch.Tensor] = {}
        self.compiled_graphs = 0
        self._graphs_at_start = 0

    def _count_layer(self, name: str):
        def hook(module, args, *rest):
            self.wrapped[name] += 1

        return hook

    def _count(self, kind: str):
        def hook(module, args, *rest):
            if kind == "recompute" and torch._C._current_graph_task_id() == -1:
                return  # a block's forward outside backward is not a recomputation
            self.calls[kind] = self.calls.get(kind, 0) + 1

        return hook

    def on_train_start(self, trainer) -> None:
        from lmforge.model.lora import LoRALinear
        from lmforge.model.qat import QATLinear
        from lmforge.model.wrap import trained_heads

        model: nn.Module = trainer.run.model
        self.heads = trained_heads(model)
        for name, p in model.named_parameters():
            if _local(p.detach()).numel() == 0:
                continue  # a shard this rank holds nothing of (FSDP2's dim-0 shard of a 1-row head): its owner checks
            self.before[name] = _local(p.detach()).clone()
            self.trainable[name] = p.requires_grad
            self.had_grad[name] = False
        for name, m in model.named_modules():
            kinds = []
            if isinstance(m, LoRALinear):
                kinds.append("lora")
                if m.nf4_meta is not None:
                    kinds.append("nf4")
            if isinstance(m, QATLinear):
                m.weight_fake_quant.register_forward_hook(self._count("fake_quant"))
            if type(m).__name__ == "Float8Linear":
                kinds.append("fp8")
            if name.endswith("mlp.router"):
                kinds.append("router")
            if name.startswith("blocks.") and name.count(".") == 1 and getattr(m, "runner", None) is not None:
                m.attn.register_forward_hook(self._count("recompute"))  # rerun in backward: recomputed
            for kind in kinds:
                m.register_forward_hook(self._count(kind))
            if {"lora", "fp8"} & set(kinds) or isinstance(m, QATLinear):
                self.wrapped[name] = 0
                m.register_forward_hook(self._count_layer(name))
        self._graphs_at_start = _graphs()

    def after_backward(self, trainer) -> None:
        for name, p in trainer.run.model.named_parameters():
            if name in self.before and p.grad is not None and bool(_local(p.grad.detach()).abs().sum() > 0):
                self.had_grad[name] = True

    def on_step_end(self, trainer, result) -> None:
        self.losses.append(float(result.loss))
        if result.clip is not None:
            self.clip_ratios.append(float(result.clip.ratio))

    def on_log(self, trainer, record: dict) -> None:
        if "rl/clip_fraction" in record:
            self.rl_clip.append(float(record["rl/clip_fraction"]))

    def on_train_end(self, trainer) -> None:
        self.after = {
            n: _local(p.detach()).clone() for n, p in trainer.run.model.named_parameters() if n in self.before
        }
        self.compiled_graphs = _graphs() - self._graphs_at_start


def _graphs() -> int:
    """Graphs Dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check(combo: tuple[str, ...], probe: Probe) -> list[str]:
    """What is wrong with a run of ``combo`` (empty: nothing): the loss finite at every step; every trainable
    parameter had a non-zero gradient and moved; every frozen one bitwise unchanged; every transform of
    :func:`transforms` counted; the gradient clip (set to bind) bound at every step; RL: the PPO clip
    (set to bind) bound at the second update of the rollouts and not at their first."""
    problems = []
    if not probe.losses or not all(math.isfinite(x) for x in probe.losses):
        problems.append(f"losses {probe.losses}")
    for name, was in probe.before.items():
        now = probe.after[name]
        if probe.trainable[name]:
            if not probe.had_grad[name]:
                problems.append(f"{name}: trainable, never a non-zero gradient")
            elif torch.equal(was, now):
                problems.append(f"{name}: trainable, did not move")
        elif not torch.equal(was, now):
            problems.append(f"{name}: frozen, changed")
        if name.startswith(tuple(h + "." for h in probe.heads)) and not probe.trainable[name]:
            problems.append(f"{name}: a head the objective trains, frozen")
    if "compile" not in combo:  # compiled code calls no Python forward of the layers it traced
        problems += [f"{n}: replaced by a wrapper, never called" for n, c in probe.wrapped.items() if not c]
    for kind in transforms(combo):
        if kind == "compiled":
            if probe.compiled_graphs == 0:
                problems.append("train.compile: no graph compiled")
        elif (kind != "recompute" or "compile" not in combo) and not probe.calls.get(kind):
            problems.append(f"{kind}: never ran")  # (compiled code reruns no Python forward to count)
    if not probe.clip_ratios or not all(r < 1 for r in probe.clip_ratios):
        problems.append(f"train.grad_clip did not bind: ratios {probe.clip_ratios}")
    if set(RL) & set(combo) and not (len(probe.rl_clip) == 2 and probe.rl_clip[0] == 0 < probe.rl_clip[1]):
        problems.append(f"rl.clip_epsilon: clipped shares {probe.rl_clip}, not 0 at update 1 and > 0 at 2")
    return problems


def table() -> str:
    """``docs/compatibility.md``: the features and every pair, works or refused (with the reason)."""
    lines = [
        "# Which features combine",
        "",
        "Generated from `tests/combinations.py` (`python -m tests.combinations > docs/compatibility.md`); "
        "`tests/test_combinations.py` runs every row below for two steps on a tiny model and checks that "
        "a row marked *works* trains (finite loss, every trainable parameter gets a gradient and moves, "
        "every frozen one stays bitwise equal, every transform asked for runs, the gradient clip binds; RL: "
        "two updates on the same rollouts, `rl.clip_epsilon` binding at the second and not at the first) and "
        "that a row marked *refused* stops before any work with one line naming both keys (exit status 2).",
        "",
        "| axis | features |",
        "|---|---|",
    ]
    for axis, values in AXES.items():
        lines.append(f"| {axis} | " + ", ".join(f"`{f.name}` (`{f.key}`)" for f in values) + " |")
    lines += ["", "| combination | result |", "|---|---|"]
    for combo in pairs():
        why = refusal(combo)
        lines.append(f"| {' + '.join(combo)} | {'refused: ' + why if why else 'works'} |")
    lines += [
        "",
        "## Layouts",
        "",
        "`tests/test_combinations_distributed.py` (the distributed set) runs each layout alone and with every "
        "feature above, two processes under torchrun (gloo), with the same checks on each rank's own shards "
        "and stages. `ep` trains the MoE model (with `parallel.dp_shard = 2`).",
        "",
        "| layout | " + " | ".join(f"`{f.name}` (`{f.key}`)" for f in LAYOUTS) + " |",
        "|---|" + "---|" * len(LAYOUTS),
    ]
    others = [f.name for values in AXES.values() for f in values[1:]]
    for name in ["alone", *others]:
        cells = []
        for layout in LAYOUTS:
            combo = (layout.name,) if name == "alone" else (layout.name, name)
            if combo not in layout_pairs(layout.name):
                cells.append("(implied)")
                continue
            why = refusal(combo)
            cells.append("refused: " + why if why else "works")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
