"""``.ci/floors.txt`` cannot drift from ``pyproject.toml``: the constraints file that ``.ci/floors`` installs
(tests/README.md, "Dependency floors") pins every declared dependency to exactly the floor it declares.

Proved statically (no install): every requirement of ``[project] dependencies`` and of the ``dev`` and
``eval`` extras (``dev``'s ``lmforge[eval]`` expanded) declares a lower bound, ``>=`` (``==`` for torch);
``.ci/floors.txt`` has exactly one ``==`` pin for each, equal to that bound; and every other pin is one
marked ``# transitive: REASON`` (a package lmforge does not declare, pinned because a floor needs it).
A raised floor in one file and not the other, a new dependency without a pin, or a pin left behind by a
removed dependency fails here.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("dev", "eval")  # the install .ci/floors makes: -e ".[dev]", which includes lmforge[eval]
TORCH = "2.13.0"  # pyproject's exact pin (a local CPU wheel; README)
TRANSITIVE = re.compile(r"#\s*transitive:\s*\S")


def declared() -> dict[str, Requirement]:
    """Canonical name -> requirement of every runtime, ``dev`` and ``eval`` dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])
    extras = project["optional-dependencies"]
    out: dict[str, Requirement] = {}
    for line in [*project["dependencies"], *(r for e in EXTRAS for r in extras[e])]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == own:  # lmforge[eval] inside dev: its requirements are read from EXTRAS already
            assert set(req.extras) <= set(EXTRAS), f"{line}: an extra that .ci/floors does not install"
            continue
        assert name not in out, f"{req.name} declared twice in pyproject.toml"
        out[name] = req
    return out


def floor(req: Requirement) -> Version:
    """The declared lower bound (``>=``, or ``==`` for an exact pin)."""
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    assert len(lows) == 1, f"{req}: needs exactly one '>=' floor (or '==' pin)"
    return lows[0]


def pins() -> list[tuple[str, Version, str]]:
    """(canonical name, version, the line) of each pin of ``.ci/floors.txt``; comments and blank lines
    skipped, anything else than ``NAME==VERSION`` refused."""
    out = []
    for raw in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,<>=!~]+)", body)
        assert m, f".ci/floors.txt: {raw!r} is not NAME==VERSION"
        out.append((canonicalize_name(m[1]), Version(m[2]), raw))
    return out


def test_every_declared_dependency_is_pinned_once_at_its_floor():
    deps = declared()
    assert "torch" in deps and "torchao" in deps  # the parse found pyproject's lists
    pinned: dict[str, list[Version]] = {}
    for name, version, _ in pins():
        pinned.setdefault(name, []).append(version)
    for name, req in deps.items():
        got = pinned.get(name, [])
        assert len(got) == 1, f"{req}: {len(got)} pins in .ci/floors.txt, want exactly one"
        assert got[0] == floor(req), f"{req}: .ci/floors.txt pins {name}=={got[0]}, the floor is {floor(req)}"
    torch = deps["torch"].specifier
    assert [s.operator for s in torch] == ["=="] and floor(deps["torch"]) == Version(TORCH), (
        f"torch{torch}: pinned exactly at {TORCH} (README), never a floor"
    )


def test_no_pin_names_an_undeclared_package_unless_marked_transitive():
    deps = declared()
    for name, _, line in pins():
        if name not in deps:
            assert TRANSITIVE.search(line), (
                f".ci/floors.txt: {line!r} pins a package pyproject.toml does not declare; remove it, or mark "
                "it '# transitive: REASON' (which floor needs it)"
            )


def test_a_pin_off_its_floor_or_an_unmarked_extra_pin_is_caught(tmp_path, monkeypatch):
    """The checks above are not vacuous: on a copy of the two files, torchao pinned one release below its
    floor, a second pin of a package, and an unmarked pin of an undeclared one each fail."""
    (tmp_path / ".ci").mkdir()
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    text = (ROOT / ".ci" / "floors.txt").read_text()
    want = f"torchao=={floor(declared()['torchao'])}"
    assert re.search(rf"^{re.escape(want)}\b", text, re.M), want
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for bad, check in [
        (
            re.sub(r"^torchao==\S+", "torchao==0.17.0", text, flags=re.M),
            test_every_declared_dependency_is_pinned_once_at_its_floor,
        ),
        (text + "\nrich==13.0.0\n", test_every_declared_dependency_is_pinned_once_at_its_floor),
        (text + "\nnot-declared==1.0\n", test_no_pin_names_an_undeclared_package_unless_marked_transitive),
    ]:
        (tmp_path / ".ci" / "floors.txt").write_text(bad)
        with pytest.raises(AssertionError):
            check()
    (tmp_path / ".ci" / "floors.txt").write_text(
        text + "\nnot-declared==1.0  # transitive: a floor needs it\n"
    )
    test_no_pin_names_an_undeclared_package_unless_marked_transitive()
