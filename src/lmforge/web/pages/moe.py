"""The mixture-of-experts visualizer (seed: 8 experts, 2 active, 4 example inputs; the gating mechanism,
the sparsity and the compute saved): a small MoE model trained here in seconds, its routers' real top-k
choice and gate weights for every token of four example inputs, the share of the experts' weights a token
uses, and the FLOPs per token against a dense model of equal total parameters
(:mod:`lmforge.web.figures_moe`)."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, render_template, request

from lmforge.web.api import BadInput, arg_int, json_api
from lmforge.web.figures_moe import EXAMPLES, RECIPE, moe_figures
from lmforge.web.registry import Page

blueprint = Blueprint("moe", __name__)

DEFAULTS = {"experts": 8, "top_k": 2, "inputs": list(EXAMPLES)}
MAX_EXPERTS = 16
MAX_CHARS = 64  # bytes of an input the model reads (its context)


def _texts() -> list[str]:
    texts = []
    for i, default in enumerate(EXAMPLES):
        text = request.args.get(f"input{i}", default)
        if not text:
            raise BadInput(f"input{i}: empty; type a few characters")
        if len(text.encode("utf-8")) > MAX_CHARS:
            raise BadInput(f"input{i}: longer than {MAX_CHARS} bytes, the model's context; shorten it")
        texts.append(text)
    return texts


@blueprint.get("/moe")
def moe_page():
    return render_template(
        "moe.html",
        title="Mixture of experts",
        defaults=DEFAULTS,
        recipe=RECIPE,
        max_experts=MAX_EXPERTS,
        max_chars=MAX_CHARS,
    )


@blueprint.get("/api/moe")
@json_api
def moe_api() -> dict[str, Any]:
    """The routing of the inputs ``input0..input3`` through the page's model with ``experts`` experts and
    ``top_k`` per token, the sparsity and the compute per token."""
    experts = arg_int("experts", DEFAULTS["experts"], lo=2, hi=MAX_EXPERTS)
    top_k = arg_int("top_k", DEFAULTS["top_k"], lo=1, hi=MAX_EXPERTS)
    if top_k > experts:
        raise BadInput(f"top_k: {top_k} exceeds experts ({experts}); choose at most {experts}")
    return moe_figures(experts, top_k, _texts())


PAGE = Page(
    "moe",
    "Mixture of experts",
    130,
    "the gating of a small MoE model trained in seconds: which experts each token of four inputs goes to "
    "and with what weight, the sparsity, and the compute saved against a dense model of equal size",
    blueprint,
)
