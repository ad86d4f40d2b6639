"""The MoE visualizer's figures, all from a real model: a small MoE transformer (lmforge's ``Transformer``
with ``model/moe.py`` layers) trained here, in memory, for a few seconds on bytes of the built-in corpus
(the Python standard library's sources that ``corpus/pystdlib.py`` reads); the routing of the example
inputs' tokens by its routers (``model/moe.py::router_scores`` and ``route``, the functions the layer's
forward runs); the sparsity; and the compute per token against a dense model of equal total parameters
(:func:`moe_flops_per_token`, on ``plan/flops.py::flops_per_token``).

Nothing is written: the trained models are kept in memory, one per (experts, experts per token)."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from lmforge.config import ModelConfig, MoEConfig
from lmforge.corpus.pystdlib import stdlib_root
from lmforge.model.loss import NextTokenLoss
from lmforge.model.moe import MoE, expert_params, moe_layers, start_step, take_aux_loss
from lmforge.model.moe_routing import route, router_logits, router_scores
from lmforge.model.transformer import Transformer
from lmforge.plan.flops import flops_per_token

EXAMPLES = (
    "def bisect_left(a, x):",
    "for key, value in items:",
    "return self._data[index]",
    "Return the number of items.",
)
CORPUS_MODULES = ("bisect.py", "heapq.py", "textwrap.py", "fnmatch.py", "colorsys.py", "string.py")
VOCAB = 256  # byte-level tokens: a token is one byte of UTF-8 text


@dataclass(frozen=True)
class Recipe:
    """The page's model and its training, small enough to train in seconds on a CPU."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    d_expert: int = 64
    seq_len: int = 64
    batch: int = 16
    steps: int = 60
    lr: float = 3e-3
    aux_loss: float = 0.1
    seed: int = 0


RECIPE = Recipe()


def moe_flops_per_token(
    n_total: int, n_routed: int, experts: int, top_k: int, n_layers: int, d_model: int, seq_len: int
) -> dict[str, float]:
    """Training FLOPs per token of an MoE model and of a dense model with the same total parameters.

    With ``N`` the non-embedding parameters (every expert counted; the output head in), ``N_r`` the
    routed experts' parameters among them, ``E`` experts of which each token uses ``k``:

    * active parameters per token ``N_a = N - N_r (1 - k / E)`` (a token runs ``k`` of the ``E`` routed
      experts; everything else, the shared experts and the routers too, runs for every token);
    * MoE: ``6 N_a + 12 L d T``; dense of equal total parameters: ``6 N + 12 L d T`` (``flops_per_token``
      of ``plan/flops.py``: 2 forward + 4 backward FLOPs per weight, plus the attention products);
    * saved: ``1 - MoE / dense``; sparsity (share of the routed experts' weights a token uses): ``k / E``.
    """
    active = n_total - n_routed * (1 - top_k / experts)
    moe = flops_per_token(round(active), n_layers, d_model, seq_len)
    dense = flops_per_token(n_total, n_layers, d_model, seq_len)
    return {
        "total_params": n_total,
        "routed_params": n_routed,
        "active_params": active,
        "moe_flops": moe,
        "dense_flops": dense,
        "saved": 1 - moe / dense,
        "sparsity": top_k / experts,
    }


def model_config(experts: int, top_k: int, recipe: Recipe = RECIPE) -> ModelConfig:
    """Every block an MoE block of ``experts`` SwiGLU experts, ``top_k`` per token, the Switch loss on."""
    moe = MoEConfig(experts=experts, top_k=top_k, d_expert=recipe.d_expert, aux_loss=recipe.aux_loss)
    return ModelConfig(n_layers=recipe.n_layers, d_model=recipe.d_model, n_heads=recipe.n_heads, moe=moe)


@functools.cache
def corpus_bytes() -> torch.Tensor:
    """The training text: a few modules of the built-in corpus, as byte ids."""
    text = "\n".join((stdlib_root() / name).read_text(encoding="utf-8") for name in CORPUS_MODULES)
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


_lock = threading.Lock()
_models: dict[tuple[int, int], tuple[Transformer, dict[str, Any]]] = {}


def trained_model(experts: int, top_k: int, recipe: Recipe = RECIPE) -> tuple[Transformer, dict[str, Any]]:
    """The page's model for (``experts``, ``top_k``), trained on first use and kept: ``(model in eval
    mode, {"losses": [first, last], "seconds", "steps", "tokens"})``. Seeded: the same weights each time."""
    key = (experts, top_k)
    with _lock:
        if key not in _models:
            _models[key] = _train(model_config(experts, top_k, recipe), recipe)
        return _models[key]


def _train(cfg: ModelConfig, recipe: Recipe) -> tuple[Transformer, dict[str, Any]]:
    data = corpus_bytes()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (4x slower on 2 cores)
    try:
        return _steps(cfg, recipe, data, t0)
    finally:
        torch.set_num_threads(threads)


def _steps(cfg: ModelConfig, recipe: Recipe, data: torch.Tensor, t0: float) -> tuple[Transformer, dict]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = Transformer(cfg, VOCAB, recipe.seq_len, attention="sdpa")
        model.init_weights()
        loss_fn = NextTokenLoss(model, 1024)
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(recipe.seed)
        losses = []
        for _ in range(recipe.steps):
            starts = torch.randint(0, len(data) - recipe.seq_len - 1, (recipe.batch,), generator=gen)
            rows = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
            start_step(model)
            total, n = loss_fn(rows[:, :-1], rows[:, 1:])
            loss = total / n
            aux = take_aux_loss(model)
            (loss if aux is None else loss + aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
    model.eval()
    info = {
        "losses": [losses[0], losses[-1]],
        "seconds": time.perf_counter() - t0,
        "steps": recipe.steps,
        "tokens": recipe.steps * recipe.batch * recipe.seq_len,
    }
    return model, info


def encode(text: str) -> list[int]:
    """The page's tokens of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


@torch.no_grad()
def routing(model: Transformer, text: str, recipe: Recipe = RECIPE) -> list[dict[str, Any]]:
    """Per MoE layer, how its router sends each token of ``text``: ``{"layer", "tokens": [the byte as
    text], "experts": [[chosen, best first] per token], "weights": [[gate weight] per token], "scores":
    [[score of every expert] per token]}``. The router's input is the layer's real input in a forward of
    the model over ``text`` (its last ``seq_len`` bytes); the choice is ``route`` as the layer runs it."""
    ids = encode(text)[-recipe.seq_len :]
    inputs: dict[str, torch.Tensor] = {}
    layers = list(moe_layers(model))
    hooks = [
        layer.register_forward_pre_hook(lambda _m, args, index=index: inputs.__setitem__(index, args[0]))
        for index, layer in layers
    ]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    out = []
    for index, layer in layers:
        x = inputs[index].reshape(-1, inputs[index].shape[-1])
        scores = router_scores(router_logits(layer.router, x), layer.score)
        bias = layer.expert_bias if layer.bias_rate else None
        experts, weights = route(scores, layer.top_k, layer.normalize, bias)
        out.append(
            {
                "layer": int(index),
                "tokens": [bytes([b]).decode("utf-8", "replace") for b in ids],
                "experts": experts.tolist(),
                "weights": weights.tolist(),
                "scores": scores.tolist(),
            }
        )
    return out


def moe_figures(experts: int, top_k: int, texts: list[str], recipe: Recipe = RECIPE) -> dict[str, Any]:
    """Everything the page draws for ``experts`` experts, ``top_k`` per token and the inputs ``texts``."""
    model, info = trained_model(experts, top_k, recipe)
    layer: MoE = next(m for _, m in moe_layers(model))
    n_routed = sum(p.numel() for p in expert_params(model))
    compute = moe_flops_per_token(
        model.num_params(), n_routed, experts, top_k, recipe.n_layers, recipe.d_model, recipe.seq_len
    )
    return {
        "experts": experts,
        "top_k": top_k,
        "score": layer.score,
        "normalize": layer.normalize,
        "model": {**model_config(experts, top_k, recipe).model_dump(), "vocab": VOCAB, **info},
        "recipe": recipe.__dict__,
        "inputs": [{"text": t, "layers": routing(model, t, recipe)} for t in texts],
        "compute": compute,
    }
