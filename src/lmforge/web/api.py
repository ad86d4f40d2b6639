"""Helpers for the pages' JSON routes: query parameters read with one-line errors, and errors answered as
``{"error": "..."}`` with status 400 (the page shows the line; nothing is computed)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from flask import jsonify, request

from lmforge.errors import UserError


class BadInput(ValueError):
    """A query parameter that cannot be used; the message names it and the fix."""


def json_api(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a route returning a dict: the dict as JSON (non-finite floats as null); BadInput, UserError and
    ValueError as ``{"error": message}`` with status 400."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        try:
            result = fn(*args, **kwargs)
        except (BadInput, UserError, ValueError) as exc:
            return jsonify({"error": str(exc)}), 400
        return jsonify(finite_json(result))

    return wrapper


def finite_json(value: Any) -> Any:
    """``value`` with every NaN / Inf float replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def arg_int(name: str, default: int, lo: int = 1, hi: int = 1 << 40) -> int:
    """The integer query parameter ``name`` in ``[lo, hi]`` (``default`` when absent)."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadInput(f"{name}: {raw!r} is not an integer; give a whole number") from None
    if not lo <= value <= hi:
        raise BadInput(f"{name}: {value} is out of range; give {lo}..{hi}")
    return value


def arg_float(name: str, default: float, lo: float = -math.inf, hi: float = math.inf) -> float:
    """The float query parameter ``name`` in ``[lo, hi]`` (``default`` when absent)."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{name}: {raw!r} is not a number") from None
    if not (math.isfinite(value) and lo <= value <= hi):
        raise BadInput(f"{name}: {value} is out of range; give {lo}..{hi}")
    return value


def arg_choice(name: str, default: str, choices: tuple[str, ...] | list[str]) -> str:
    """The query parameter ``name``, one of ``choices`` (``default`` when absent)."""
    value = request.args.get(name) or default
    if value not in choices:
        raise BadInput(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return value
