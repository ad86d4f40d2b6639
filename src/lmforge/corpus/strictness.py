"""A pipeline recipe at a strictness level: the thresholds of its filtering stages moved together.

Each stage declares its knobs (:class:`~lmforge.corpus.stages.base.Knob`: a parameter, its lenient and
its strict value). At level 0 no stage with ``filters = True`` runs (stages that only change text, such
as ``extract``, ``normalize`` and ``pii``, still do). At a level ``L`` in (0, 100] every knob's parameter
is set to ``lenient + (strict - lenient) * L / 100`` (a table entry by entry; an on/off rule is on from
level 50); a parameter the recipe sets to ``None`` or ``false`` (rule off) stays off, and parameters
without a knob keep the recipe's value. Level 100 is the strictest documented
setting of every stage (for most, the published values that are also their defaults).
"""

from __future__ import annotations

from typing import Any

from lmforge.corpus.config import PipelineConfig, StageSpec
from lmforge.corpus.stages.registry import stage_class
from lmforge.errors import ConfigError


def check_level(level: float, where: str = "--levels") -> float:
    """``level`` if it lies in [0, 100], else a ConfigError naming ``where``."""
    if not 0 <= level <= 100:
        raise ConfigError(f"{where}: strictness level {level:g} is outside 0..100")
    return level


def spec_at(spec: StageSpec, level: float) -> StageSpec | None:
    """``spec`` with its knobs at ``level``; None when the stage filters and ``level`` is 0."""
    cls = stage_class(spec.name)
    if level == 0 and cls.filters:
        return None
    if not cls.strictness:
        return spec
    defaults = cls.Params().model_dump() if _has_all_defaults(cls) else {}
    params: dict[str, Any] = dict(spec.params)
    for knob in cls.strictness:
        configured = params.get(knob.param, defaults.get(knob.param, 0))
        if configured is None or configured is False:  # a rule turned off stays off at every level
            continue
        params[knob.param] = knob.value(level)
    cls.Params.model_validate(params)  # a knob outside a parameter's range is a bug in the stage
    return StageSpec(name=spec.name, domains=spec.domains, params=params)


def _has_all_defaults(cls: Any) -> bool:
    """Whether the stage's parameters can be built without any value (no required field)."""
    return all(not f.is_required() for f in cls.Params.model_fields.values())


def config_at(cfg: PipelineConfig, level: float) -> PipelineConfig:
    """A copy of ``cfg`` whose stages run at strictness ``level`` (filters dropped at 0)."""
    check_level(level)
    stages = [s for s in (spec_at(spec, level) for spec in cfg.stages) if s is not None]
    return cfg.model_copy(update={"stages": stages})


def knob_table(cfg: PipelineConfig, levels: list[float]) -> dict[str, dict[str, list[Any]]]:
    """Per stage label and knob, the value at each level (``None``: stage not run or rule off)."""
    table: dict[str, dict[str, list[Any]]] = {}
    seen: dict[str, int] = {}
    for spec in cfg.stages:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        label = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
        cls = stage_class(spec.name)
        if not cls.strictness:
            continue
        rows: dict[str, list[Any]] = {}
        for knob in cls.strictness:
            rows[knob.param] = []
            for level in levels:
                at = spec_at(spec, level)
                rows[knob.param].append(None if at is None else at.params.get(knob.param))
        table[label] = rows
    return table
