"""The typed configuration of ``lmforge data``: sources, stages, output, execution, tokenizer.

A pipeline recipe (``configs/data/*.toml``) is a document of its own, not a section of the training
recipe, so its model lives here rather than in :mod:`lmforge.config`: validating a stage's parameters
needs the stage's ``Params`` model, which lives with the stage, and the training configuration must not
import the data stages. The conventions are the same: pydantic, unknown keys are errors, every field
has a description and a default in this one place, problems are one-line :class:`ConfigError` naming
the key.

    [[sources]]
    path = "crawl/*.jsonl.zst"
    domain = "web"

    [[stages]]
    name = "length"          # a registered stage
    domains = ["web"]        # optional: apply only to these domains
    min_words = 20           # the stage's own parameters, checked by its Params model

    [output]
    compression = "zstd"
"""

from __future__ import annotations

import difflib
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lmforge.corpus.stages.registry import STAGES, available, stage_class
from lmforge.errors import ConfigError
from lmforge.recipe import config_keys, describe_error, dump_toml, read_recipe


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PipelineSource(_Section):
    """One input: a file, folder or glob (or ``builtin:pystdlib``) and how to read its records."""

    path: str = Field(..., description="a file, folder (searched recursively), glob, or builtin:pystdlib")
    format: Literal["auto", "txt", "jsonl", "parquet", "html", "pdf"] = Field(
        "auto",
        description="reader: auto picks by suffix (.txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet, .html, .htm, .pdf)",
    )
    text_field: str = Field("text", description="JSON key / parquet column holding the text")
    id_field: str = Field("id", description="JSON key / parquet column holding the id (else path:line)")
    domain: str | None = Field(
        None, description="domain of its documents (default: 'default'; pystdlib: code/prose)"
    )
    content_format: Literal["text", "html"] = Field(
        "text", description="jsonl/txt: html marks every document as raw HTML for the extract stage"
    )
    format_field: str | None = Field(
        None, description="jsonl: key whose value 'html' marks that record as raw HTML"
    )


class StageSpec(BaseModel):
    """One pipeline step: a registered stage, the domains it applies to, its validated parameters."""

    model_config = ConfigDict(extra="forbid")

    name: str
    domains: list[str] | None = None
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def kind(self) -> str:
        from lmforge.corpus.stages.base import CorpusStage

        return "corpus" if issubclass(stage_class(self.name), CorpusStage) else "doc"

    def build(self) -> Any:
        cls = stage_class(self.name)
        return cls(cls.Params.model_validate(self.params))

    def to_tree(self) -> dict[str, Any]:
        head: dict[str, Any] = {"name": self.name}
        if self.domains is not None:
            head["domains"] = list(self.domains)
        return head | self.params


class OutputConfig(_Section):
    compression: Literal["zstd", "none"] = Field(
        "zstd", description="kept/ and removed/ files: zstd (.jsonl.zst) or none (.jsonl)"
    )
    zstd_level: int = Field(3, ge=1, le=19, description="zstd compression level")
    bad_input_listed: int = Field(
        1000, ge=0, description="bad-input records listed in report.json (all are counted and in removed/)"
    )
    removed_text: bool = Field(
        False,
        description="removed/ records also keep the document's text as the stage that removed it saw it "
        "(off: id, source, rule, value and threshold only; on: removed/ grows to about the size of its "
        "documents' text)",
    )


class ExecutionConfig(_Section):
    executor: Literal["local", "ray"] = Field(
        "local", description="local: worker processes on this machine; ray: tasks on a Ray cluster"
    )
    workers: int = Field(0, ge=0, description="parallel workers (0: every core this process may use)")
    chunk_bytes: int = Field(
        4 * 2**20,
        ge=1024,
        description="input per shard: files are grouped and large files cut to about this size",
    )
    max_error_fraction: float = Field(
        0.001,
        ge=0,
        le=1,
        description="stage errors (exceptions; the document is removed as `<stage>.error`) allowed per stage, "
        "as a share of the documents it was given; past it the run stops after the pass (exit status 2) "
        "and the same command continues once the stage is fixed",
    )


class TokenizeConfig(_Section):
    enabled: bool = Field(True, description="train a tokenizer on the kept documents and write token shards")
    vocab_size: int = Field(
        4096, ge=260, le=2**32 - 1, description="BPE vocabulary size (with special tokens)"
    )
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="share of documents held out, by id hash")
    tokenizer: str | None = Field(None, description="path of an existing tokenizer.json (default: train one)")


class PipelineConfig(_Section):
    sources: list[PipelineSource] = Field(..., min_length=1, description="inputs, read in this order")
    stages: list[StageSpec] = Field(default_factory=list, description="stages, applied in this order")
    output: OutputConfig = Field(default_factory=OutputConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    tokenize: TokenizeConfig = Field(default_factory=TokenizeConfig)

    @field_validator("stages", mode="before")
    @classmethod
    def _stages(cls, value: Any) -> list[dict[str, Any]]:
        if not isinstance(value, list):
            raise ValueError("stages: give a list of tables ([[stages]] with a name)")
        return [_stage_entry(i, entry) for i, entry in enumerate(value)]

    def to_tree(self) -> dict[str, Any]:
        """The configuration as TOML-shaped data (stage parameters flat, as written in a recipe)."""
        tree = self.model_dump(mode="json", exclude_none=True)
        tree["stages"] = [s.to_tree() for s in self.stages]
        return tree

    def to_toml(self) -> str:
        return dump_toml(self.to_tree())

    def fingerprint(self) -> str:
        """Hash of what shapes the output: not how it is executed (executor, workers, error budget), but
        the shard size."""
        tree = self.to_tree()
        tree["execution"] = {"chunk_bytes": self.execution.chunk_bytes}
        return hashlib.sha256(json.dumps(tree, sort_keys=True).encode()).hexdigest()[:16]


def _stage_entry(i: int, entry: Any) -> dict[str, Any]:
    where = f"stages[{i}]"
    if isinstance(entry, StageSpec):
        entry = entry.to_tree()
    if not isinstance(entry, dict) or "name" not in entry:
        raise ValueError(f"{where}: each stage is a table with a name (one of {', '.join(STAGES)})")
    entry = dict(entry)
    name = entry.pop("name")
    domains = entry.pop("domains", None)
    if not isinstance(name, str):
        raise ValueError(f"{where}.name: give a stage name as a string")
    if domains is not None and not (isinstance(domains, list) and all(isinstance(d, str) for d in domains)):
        raise ValueError(f'{where}.domains: give a list of domain names, e.g. ["web"]')
    cls = stage_class(name, where)
    try:
        params = cls.Params.model_validate(entry)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            match = difflib.get_close_matches(loc, list(cls.Params.model_fields), n=1, cutoff=0.5)
            hint = f"; did you mean {match[0]}?" if match else ""
            known = ", ".join(cls.Params.model_fields) or "none"
            raise ValueError(
                f"{where}.{loc}: unknown parameter of stage {name}{hint} (its parameters: {known})"
            ) from None
        text = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if err["type"] != "value_error" else ""
        raise ValueError(f"{where}{'.' + loc if loc else ''}: {name}: {text}{got}") from None
    return {"name": name, "domains": domains, "params": params.model_dump(mode="json")}


def _keys() -> list[str]:
    keys = [k for k in config_keys(PipelineConfig) if k not in ("sources", "stages")]
    return keys + [f"sources.{k}" for k in PipelineSource.model_fields] + ["stages.name", "stages.domains"]


def build_pipeline_config(tree: dict[str, Any]) -> PipelineConfig:
    """Validate a nested dict into a :class:`PipelineConfig`; ConfigError names the first bad key."""
    try:
        return PipelineConfig.model_validate(tree)
    except ConfigError:
        raise
    except ValidationError as exc:
        raise ConfigError(describe_error(exc.errors()[0], _keys())) from None


def load_pipeline_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A pipeline recipe at ``path`` with dotted ``overrides`` (``execution.workers``) applied."""
    return build_pipeline_config(read_recipe(path, overrides, "a pipeline recipe (see configs/data/)"))


def reference_markdown() -> str:
    """The pipeline configuration reference as Markdown (``docs/data-config.md`` is this text)."""
    out = [
        "# Data pipeline configuration reference",
        "",
        "Keys of a `lmforge data` recipe (`configs/data/*.toml`), their defaults and meaning, then every",
        "stage with its parameters. The rules' sources, what a removal records, and the extraction",
        "measured on real pages are in [data-stages.md](data-stages.md). This file is generated from",
        "`lmforge/corpus/config.py` and the stage modules:",
        "`python -c \"from lmforge.corpus.config import reference_markdown as r; print(r(), end='')\" > docs/data-config.md`.",
        "",
        "## Sources (`[[sources]]`, one table per input)",
        "",
        "| key | default | meaning |",
        "|---|---|---|",
    ]
    out += [_row(k, f) for k, f in PipelineSource.model_fields.items()]
    for section, model in (
        ("output", OutputConfig),
        ("execution", ExecutionConfig),
        ("tokenize", TokenizeConfig),
    ):
        out += ["", f"## `[{section}]`", "", "| key | default | meaning |", "|---|---|---|"]
        out += [_row(f"{section}.{k}", f) for k, f in model.model_fields.items()]
    out += [
        "",
        "## Stages (`[[stages]]`, applied in order)",
        "",
        "Each entry has `name`, optionally `domains = [...]` (the stage then applies only to documents of",
        "those domains; others pass through unchanged), and the stage's own parameters below. Removal",
        "reasons are `<stage>.<rule>`.",
    ]
    from lmforge.corpus.stages.base import CorpusStage

    for name, cls in available().items():
        kind = (
            "corpus stage (signature, plan, apply)" if issubclass(cls, CorpusStage) else "per-document stage"
        )
        doc = (sys.modules[cls.__module__].__doc__ or "").strip()
        first = doc.split("\n\n")[0].replace("\n", " ")
        out += ["", f"### `{name}` ({kind})", "", first, ""]
        fields = cls.Params.model_fields
        if fields:
            out += ["| parameter | default | meaning |", "|---|---|---|"]
            out += [_row(k, f) for k, f in fields.items()]
        else:
            out.append("No parameters.")
        out += _strictness_lines(cls)
    return "\n".join(out) + "\n"


def _knob_range(knob: Any) -> str:
    if isinstance(knob.strict, bool):
        return "off → on (from level 50)"
    if isinstance(knob.strict, dict):
        return f"{knob.lenient:g} → " + "{" + ", ".join(f"{n}: {v:g}" for n, v in knob.strict.items()) + "}"
    return f"{knob.lenient:g} → {knob.strict:g}"


def _strictness_lines(cls: Any) -> list[str]:
    """How ``lmforge data sweep`` moves the stage from lenient to strict (docs/data.md)."""
    if not cls.filters:
        return ["", "Strictness: not a filter; it runs at every level of `lmforge data sweep`, 0 included."]
    if not cls.strictness:
        return ["", "Strictness: left out at level 0; no threshold moves, the same at every level above 0."]
    knobs = ", ".join(f"`{k.param}` {_knob_range(k)}" for k in cls.strictness)
    return ["", f"Strictness (lenient → strict, level 0: left out): {knobs}."]


def _row(key: str, field: Any) -> str:
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    shown = "required" if field.is_required() else f"`{json.dumps(default)}`"
    return f"| `{key}` | {shown} | {field.description or ''} |"
