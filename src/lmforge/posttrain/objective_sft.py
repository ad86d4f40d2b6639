"""``train.objective = "sft"``: the next-token loss on the response tokens of ``[posttrain]`` records.

The language model's network, loss and training module (``train/modules.py::LanguageModel``: targets are
-100 outside the responses, so ``NextTokenLoss`` is unchanged) over post-training's records and loader
(``posttrain/run.py::PostTraining``). Registered for the build by the ``lmforge.objectives`` entry point
``sft`` (``pyproject.toml``).
"""

from __future__ import annotations

from lmforge.posttrain.run import PostTraining
from lmforge.train.modules import LanguageModel


class SupervisedFineTuning(PostTraining, LanguageModel):
    """The data hooks of :class:`PostTraining`, the rest of :class:`LanguageModel`."""

    rows = 1


OBJECTIVE = SupervisedFineTuning()
