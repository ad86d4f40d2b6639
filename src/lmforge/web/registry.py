"""The pages of the web app: every module of ``lmforge.web.pages`` that defines ``PAGE`` (a :class:`Page`),
in ``order``. A module whose ``PAGE`` is None is a page lmforge cannot show yet (it is left out of the
navigation and its address answers 404, rather than showing something invented)."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from flask import Blueprint


@dataclass(frozen=True)
class Page:
    """One page: its address ``/<slug>``, navigation title, place in the navigation, a one-line summary
    for the index, and the blueprint that serves the page and its ``/api/<slug>/...`` routes."""

    slug: str
    title: str
    order: int
    summary: str
    blueprint: Blueprint
    group: str = "planners"  # "runs" or "planners": where the index lists it


def pages() -> list[Page]:
    """Every page of ``lmforge.web.pages``, by ``order``."""
    from lmforge.web import pages as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        page = getattr(module, "PAGE", None)
        if page is not None:
            found.append(page)
    return sorted(found, key=lambda p: (p.order, p.slug))
