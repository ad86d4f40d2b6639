"""Stage names -> classes, imported only when a pipeline names them.

The table is the one agreed in the data pipeline's design: a stage module is imported the first time a
configuration uses it, so a pipeline that does not need language identification never imports its
model, and a stage whose module is not installed is reported by name instead of breaking every run.
"""

from __future__ import annotations

import difflib
import importlib

from lmforge.corpus.stages.base import CorpusStage, DocStage
from lmforge.errors import ConfigError

STAGES: dict[str, str] = {
    "extract": "lmforge.corpus.stages.extract:Extract",
    "normalize": "lmforge.corpus.stages.normalize:Normalize",
    "langid": "lmforge.corpus.stages.langid:LangId",
    "gopher_quality": "lmforge.corpus.stages.quality:GopherQuality",
    "gopher_repetition": "lmforge.corpus.stages.quality:GopherRepetition",
    "c4": "lmforge.corpus.stages.quality:C4Filter",
    "fineweb": "lmforge.corpus.stages.quality:FineWebFilter",
    "code_quality": "lmforge.corpus.stages.quality:CodeQuality",
    "pii": "lmforge.corpus.stages.pii:PiiRedact",
    "length": "lmforge.corpus.stages.length:LengthFilter",
    "classifier": "lmforge.corpus.stages.classifier:Classifier",
    "blocklist": "lmforge.corpus.stages.blocklist:Blocklist",
    "dedup_exact": "lmforge.corpus.stages.dedup_exact:ExactDedup",
    "dedup_minhash": "lmforge.corpus.stages.dedup_minhash:MinHashDedup",
    "dedup_substring": "lmforge.corpus.stages.dedup_substring:SubstringDedup",
    "perplexity": "lmforge.corpus.stages.perplexity:Perplexity",
}

StageClass = type[DocStage] | type[CorpusStage]


class StageUnavailable(ConfigError):
    """A known stage whose module is not part of this installation."""


def stage_class(name: str, where: str = "stages") -> StageClass:
    """The class registered as ``name``; ConfigError naming ``where`` if unknown or not installed."""
    target = STAGES.get(name)
    if target is None:
        match = difflib.get_close_matches(name, list(STAGES), n=1, cutoff=0.6)
        hint = f"did you mean {match[0]}? " if match else ""
        raise ConfigError(f"{where}.name: unknown stage {name!r}; {hint}stages are {', '.join(STAGES)}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise StageUnavailable(
            f"{where}.name: stage {name!r} is not installed ({module_name} is missing); "
            "remove it from the pipeline or install a version of lmforge that has it"
        ) from None
    cls = getattr(module, cls_name)
    if not (isinstance(cls, type) and issubclass(cls, DocStage | CorpusStage)):
        raise TypeError(f"{target} is not a DocStage or CorpusStage")
    return cls


def available() -> dict[str, StageClass]:
    """The registered stages whose modules import here, in table order."""
    out: dict[str, StageClass] = {}
    for name in STAGES:
        try:
            out[name] = stage_class(name)
        except StageUnavailable:
            continue
    return out
