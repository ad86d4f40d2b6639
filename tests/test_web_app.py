"""The web app's frame: read-only access to RUNS_DIR only, Plotly served from the installed package, the
index in a real browser, and ``lmforge dashboard``'s one-line errors."""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.web.app import create_app
from lmforge.web.paths import PathRefused, resolve_under
from lmforge.web.registry import pages
from tests.conftest import screenshot


@pytest.fixture
def runs_tree(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "config.toml").write_text("[train]\nsteps = 3\n")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", runs / "a" / "link_out.txt")
    os.symlink(tmp_path, runs / "up")
    return runs


def test_resolve_under_refuses_paths_outside(runs_tree: Path):
    assert resolve_under(runs_tree, "a/config.toml") == (runs_tree / "a" / "config.toml").resolve()
    for bad in ["../secret.txt", "a/../../secret.txt", "/etc/passwd", "a/link_out.txt", "up/secret.txt", ""]:
        with pytest.raises(PathRefused):
            resolve_under(runs_tree, bad)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_server_serves_only_files_under_runs_dir(runs_tree: Path, serve):
    url = serve(runs_tree)
    assert _status(f"{url}/files/a/config.toml") == 200
    with urllib.request.urlopen(f"{url}/files/a/config.toml") as r:
        assert r.read() == b"[train]\nsteps = 3\n"
    for bad in ["a/link_out.txt", "up/secret.txt", "%2Fetc%2Fpasswd", "a/%2E%2E/%2E%2E/secret.txt"]:
        assert _status(f"{url}/files/{bad}") in (403, 404), bad
    assert _status(f"{url}/files/a/missing.txt") == 404
    req = urllib.request.Request(f"{url}/files/a/config.toml", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 405  # read-only: no route writes
    assert (runs_tree / "a" / "config.toml").read_text() == "[train]\nsteps = 3\n"


def test_plotly_comes_from_the_installed_package(runs_tree: Path):
    client = create_app(runs_tree).test_client()
    r = client.get("/assets/plotly.min.js")
    assert r.status_code == 200 and b"plotly" in r.data[:2000].lower()


def test_moe_page_is_listed_now_that_there_is_an_moe_layer(runs_tree: Path):
    client = create_app(runs_tree).test_client()
    assert client.get("/moe").status_code == 200  # the page only; its model trains on its first /api/moe
    assert "moe" in {p.slug for p in pages() if p.group == "planners"}


def test_index_lists_every_page_in_a_browser(runs_tree: Path, serve, page, tmp_path: Path):
    url = serve(runs_tree)
    page.goto(url)
    links = page.locator("ul.tools a").evaluate_all("els => els.map(e => e.getAttribute('href'))")
    assert links == [f"/{p.slug}" for p in pages() if p.group == "runs"] + [
        f"/{p.slug}" for p in pages() if p.group == "planners"
    ]
    screenshot(page, "index", tmp_path)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["dashboard", "/nonexistent/runs"], "RUNS_DIR"),
        (["dashboard", ".", "--port", "70000"], "--port"),
    ],
)
def test_dashboard_bad_input_exits_2(argv, needle, capsys, cli_logging):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_dashboard_port_in_use_exits_2(runs_tree: Path, serve, capsys, cli_logging):
    url = serve(runs_tree)
    port = url.rsplit(":", 1)[1]
    with pytest.raises(SystemExit) as exc:
        main(["dashboard", str(runs_tree), "--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_web_package_never_writes_and_nothing_below_imports_it():
    """The app is read-only by construction: no module of ``lmforge/web`` opens a file for writing, makes,
    moves or deletes one; and only the CLI imports ``lmforge.web`` (it sits above everything it reads)."""
    import re

    import lmforge

    src = Path(lmforge.__file__).parent
    writes = re.compile(
        r"write_text|write_bytes|\.mkdir\(|\.unlink\(|\.rename\(|\.replace\(\s*[A-Za-z_]|shutil\."
        r"|open\([^)]*['\"][wax+]"
    )
    for path in sorted((src / "web").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not writes.search(line), f"{path}:{n}: {line.strip()}"
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith(("web/", "cli/")):
            continue
        assert "lmforge.web" not in path.read_text(), f"{rel} imports lmforge.web"


def test_pages_load_nothing_from_the_internet_and_bind_locally_by_default():
    """Every script, style and image a page names is served by the app itself (Plotly from the installed
    package), so the tools work with no internet; and ``lmforge dashboard`` listens on 127.0.0.1 unless
    told otherwise."""
    import re

    import lmforge
    from lmforge.cli import build_parser

    web = Path(lmforge.__file__).parent / "web"
    external = re.compile(r"""(src|href)\s*=\s*["'](https?:)?//""", re.I)
    for path in [*web.glob("templates/*.html"), *web.glob("static/*")]:
        text = path.read_text()
        assert not external.search(text), path
        assert 'fetch("http' not in text and "fetch('http" not in text, path
    args = build_parser().parse_args(["dashboard"])
    assert (args.host, args.port, args.runs_dir) == ("127.0.0.1", 8765, "runs")


class _Terminal:
    """A stand-in for sys.stdout / sys.stderr that says it is a terminal (and drops what is written)."""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def _request_log(runs: Path, serve, caplog) -> list[str]:
    """The request log's lines (werkzeug's logger) for one found and one missing file."""
    url = serve(runs)
    with caplog.at_level(logging.INFO, logger="werkzeug"):
        caplog.clear()
        assert _status(f"{url}/files/a/config.toml") == 200
        assert _status(f"{url}/files/a/missing.txt") == 404
        for _ in range(100):  # the server thread logs after it answered
            if len(caplog.records) >= 2:
                break
            time.sleep(0.02)
    return [r.getMessage() for r in caplog.records if r.name == "werkzeug"]


def test_request_log_has_no_colour_codes_when_piped(runs_tree: Path, serve, caplog, monkeypatch):
    """Piped (pytest captures stdout and stderr: not terminals), the request log's lines are plain; on a
    terminal werkzeug colours them (a 404 in yellow)."""
    piped = _request_log(runs_tree, serve, caplog)
    assert len(piped) == 2 and not [line for line in piped if "\x1b[" in line], piped
    assert '"GET /files/a/missing.txt HTTP/1.1" 404' in piped[1]
    monkeypatch.setattr(sys, "stdout", _Terminal())
    monkeypatch.setattr(sys, "stderr", _Terminal())
    coloured = _request_log(runs_tree, serve, caplog)
    assert "\x1b[33m" in coloured[1]
