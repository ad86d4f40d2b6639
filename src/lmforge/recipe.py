"""Recipes in and out: TOML reading and writing, dotted command-line overrides, error wording and the
generated configuration reference.

A configuration is built from three layers, later ones winning: the defaults of the schema
(:mod:`lmforge.config`), an optional TOML recipe, and dotted command-line overrides
(``--optim.lr=3e-4``). The result is validated before any data or model work starts; every problem is
reported as a one-line :class:`~lmforge.errors.ConfigError` naming the dotted key.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from lmforge.config import Config
from lmforge.errors import ConfigError

# Keys that moved, old -> new. A recipe or override that still uses an old key is an error naming the new
# one (values are not carried over silently: the user sees where the setting lives now).
MOVED: dict[str, str] = {
    "model.attention": "train.attention",
    "model.loss_chunk": "train.loss_chunk",
    "schedule.decay_fraction": "schedule.wsd.decay_fraction",
    "schedule.decay_shape": "schedule.wsd.decay_shape",
    "schedule.step_size": "schedule.step.step_size",
    "schedule.gamma": "schedule.step.gamma",
    "schedule.power": "schedule.polynomial.power",
    "schedule.cycle_steps": "schedule.cyclic.cycle_steps",
    "schedule.div_factor": "schedule.one_cycle.div_factor",
    "schedule.patience": "schedule.plateau.patience",
    "schedule.factor": "schedule.plateau.factor",
    "schedule.threshold": "schedule.plateau.threshold",
    "optim.momentum": "optim.sgd.momentum",
    "optim.nesterov": "optim.sgd.nesterov",
    "optim.muon_lr": "optim.muon.lr",
    "optim.muon_momentum": "optim.muon.momentum",
    "optim.muon_nesterov": "optim.muon.nesterov",
    "optim.muon_ns_steps": "optim.muon.ns_steps",
    "optim.muon_scale": "optim.muon.scale",
    "train.clip_value": "train.value_clip.limit",
    "train.clip_factor": "train.adaptive_clip.factor",
    "train.clip_beta": "train.adaptive_clip.beta",
    "train.clip_warmup": "train.adaptive_clip.warmup",
}


def _section_model(field: Any) -> type[BaseModel] | None:
    """The class of a field that is itself a table of settings (a section or a sub-table), else None."""
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def config_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, Any]:
    """All dotted keys of a config class mapped to their pydantic field info (sections are recursed)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        section = _section_model(field)
        if section is not None:
            out.update(config_keys(section, key + "."))
        else:
            out[key] = field
    return out


def _nearest(key: str, keys: list[str] | None = None) -> str:
    keys = list(config_keys()) if keys is None else keys
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else ""


def parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, arrays, quoted strings, inline tables); a list or
    table that TOML does not read as JSON (``[{"path": "x.txt"}]``, the form ``--help`` prints); else a
    bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if text.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(text)
        except ValueError:
            pass
    return text


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """``["--optim.lr=3e-4", "--train.steps", "20"]`` -> ``{"optim.lr": 3e-4, "train.steps": 20}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{arg[2:]}: missing value; write --{arg[2:]}=VALUE")
        out[key] = parse_value(value)
        i += 1
    return out


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: {part} is not a section{_nearest(key)}")
        node = child
    node[parts[-1]] = value


def describe_error(error: dict[str, Any], keys: list[str] | None = None) -> str:
    """One line for a pydantic error; ``keys`` are the valid dotted keys (default: the training config's)."""
    loc = ".".join(str(p) for p in error["loc"])
    kind = error["type"]
    if kind == "extra_forbidden":
        if keys is not None:  # lists of tables: compare without the index
            return f"{loc}: unknown key{_nearest(re.sub(r'[.][0-9]+[.]', '.', loc), keys)}"
        return f"{loc}: unknown key{_nearest(loc)}"
    msg = error["msg"]
    if kind == "value_error":
        text = msg.removeprefix("Value error, ")
        return text if ":" in text.split(" ")[0] else f"{loc}: {text}"
    value = error.get("input")
    return f"{loc}: {msg} (got {value!r})"


def _check_moved(tree: dict[str, Any]) -> None:
    """ConfigError ``old: moved to new`` for the first key of :data:`MOVED` present in ``tree``."""
    for old, new in MOVED.items():
        *parents, last = old.split(".")
        node: Any = tree
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            raise ConfigError(f"{old}: moved to {new}")


def migrate_moved(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` with every key of :data:`MOVED` put at its new place: for configs that lmforge
    itself saved before a key moved (run folders, checkpoints), which must keep loading. A user's recipe
    is not migrated: it gets the ``moved to`` error, so the recipe gets fixed."""
    out = copy.deepcopy(tree)
    for old, new in MOVED.items():
        *parents, last = old.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            _set_dotted(out, new, node.pop(last))
    return out


def load_saved_config(path: str | Path) -> Config:
    """A config that lmforge wrote (a run's or checkpoint's ``config.toml``), with moved keys migrated."""
    return build_config(migrate_moved(read_recipe(path, None, "a run folder's config.toml")))


def build_config(tree: dict[str, Any]) -> Config:
    """Validate a nested dict into a :class:`Config`, raising ConfigError with the first bad key (a key
    that moved is named with its new place)."""
    _check_moved(tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc.errors()[0])) from None


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    defaults: dict[str, Any] | None = None,
) -> Config:
    """Defaults <- dotted ``defaults`` (a command's own, e.g. fine-tuning's) <- TOML recipe at ``path`` <-
    dotted ``overrides``; validated."""
    tree: dict[str, Any] = {}
    for key, value in (defaults or {}).items():
        _set_dotted(tree, key, value)
    top = read_recipe(path, overrides, "the path of a TOML recipe (see configs/)")
    return build_config(deep_merge(tree, top) if defaults else top)


def read_recipe(path: str | Path | None, overrides: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """The TOML tree at ``path`` (empty without one) with dotted ``overrides`` set; ConfigError naming
    ``--config`` and ``what`` to give instead when the file is missing or not TOML."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file; give {what}")
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    return tree


def dump_toml(tree: dict[str, Any]) -> str:
    """Write a nested dict of TOML-able values (tables, arrays of tables, scalars, lists)."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):  # inline table, e.g. a phase's weights inside [[data.phases]]
            return "{" + ", ".join(f"{key(k)} = {scalar(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    def key(k: str) -> str:  # bare when TOML allows it, else quoted (a domain named "web.en")
        return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else scalar(k)

    lines: list[str] = []

    def table(node: dict[str, Any], name: str) -> None:
        plain = {k: v for k, v in node.items() if not isinstance(v, dict) and not _is_table_list(v)}
        if name:
            lines.append(f"[{name}]")
        lines.extend(f"{key(k)} = {scalar(v)}" for k, v in plain.items())
        if plain or name:
            lines.append("")
        for k, v in node.items():
            full = f"{name}.{k}" if name else k
            if isinstance(v, dict):
                table(v, full)
            elif _is_table_list(v):
                for item in v:
                    lines.append(f"[[{full}]]")
                    lines.extend(f"{key(ik)} = {scalar(iv)}" for ik, iv in item.items())
                    lines.append("")

    table(tree, "")
    return "\n".join(lines).rstrip() + "\n"


def to_toml(cfg: Config) -> str:
    """The resolved configuration as TOML (round-trips through :func:`load_config`)."""
    return dump_toml(cfg.model_dump(mode="json", exclude_none=True))


def _is_table_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _item_model(field: Any) -> type[BaseModel] | None:
    """The item class of a ``list[SomeSection]`` field (its entries are ``[[section.key]]`` tables)."""
    args = getattr(field.annotation, "__args__", ())
    if getattr(field.annotation, "__origin__", None) is list and args and issubclass(args[0], BaseModel):
        return args[0]
    return None


Row = tuple[str, Any, str]  # dotted key, default (JSON-able), description


def reference_sections() -> list[tuple[str, str, list[Row]]]:
    """(dotted name, description, rows) of every section and sub-table, in schema order; a section's own
    keys come before its sub-tables. Entries of a list of tables are rows ``key[].name``."""
    defaults = Config().model_dump(mode="json")
    out: list[tuple[str, str, list[Row]]] = []
    for name, field in Config.model_fields.items():
        model = _section_model(field)
        assert model is not None, f"Config.{name} is not a section"
        out += _sections(name, field.description or "", model, defaults[name])
    return out


def _sections(
    name: str, text: str, model: type[BaseModel], defaults: dict[str, Any]
) -> list[tuple[str, str, list[Row]]]:
    rows: list[Row] = []
    subs: list[tuple[str, str, list[Row]]] = []
    for field_name, field in model.model_fields.items():
        key = f"{name}.{field_name}"
        sub = _section_model(field)
        if sub is not None:
            subs += _sections(key, field.description or "", sub, defaults[field_name])
            continue
        rows.append((key, defaults[field_name], field.description or ""))
        item = _item_model(field)
        if item is not None:  # the keys of one [[key]] entry, with an entry's defaults
            entry = item.model_construct().model_dump(mode="json")
            for entry_name, entry_field in item.model_fields.items():
                rows.append((f"{key}[].{entry_name}", entry[entry_name], entry_field.description or ""))
    return [(name, text, rows), *subs]


def reference_text() -> str:
    """Every config key with its default and description, under a header line per section and sub-table
    (for ``lmforge train --help``)."""
    blocks = []
    for name, text, rows in reference_sections():
        lines = [f"[{name}]  {text}"]
        lines += [f"  --{key}={json.dumps(value)}  {meaning}" for key, value, meaning in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def reference_markdown() -> str:
    """The configuration reference as Markdown (``docs/config.md`` is this text)."""
    out = [
        "# Configuration reference",
        "",
        "Every key, its default and its meaning. Set keys in a TOML recipe (`[section]` then `key = value`)",
        "or on the command line as `--section.key=value` (values are parsed as TOML: `--optim.betas=[0.9, 0.99]`;",
        'a list or table also as JSON, as this page prints it: `--data.sources=\'[{"path": "x.txt"}]\'` reads as',
        "`--data.sources=\"[{path='x.txt'}]\"`).",
        "Settings that belong to one choice sit in a sub-table named after it: `[schedule.wsd]` in a recipe,",
        "`--schedule.wsd.decay_fraction=0.3` on the command line.",
        "This file is generated from `lmforge/config.py` by `lmforge/recipe.py`:",
        "`python -c \"from lmforge.recipe import reference_markdown as r; print(r(), end='')\" > docs/config.md`.",
    ]
    for name, text, rows in reference_sections():
        out += ["", f"## `[{name}]`", "", text, "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{key}` | `{json.dumps(value)}` | {meaning} |" for key, value, meaning in rows]
    return "\n".join(out) + "\n"
