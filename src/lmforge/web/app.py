"""The Flask application: the pages of :mod:`lmforge.web.registry`, Plotly's JavaScript from the installed
``plotly`` package (no internet needed), and read-only access to the files under RUNS_DIR.

Only GET routes exist (the app never writes). ``/files/<path>`` serves a file under RUNS_DIR; a path
outside it (absolute, ``..``, a symbolic link out) answers 403 (``web/paths.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flask import Flask, abort, render_template, send_file

from lmforge.errors import UserError
from lmforge.web.paths import PathRefused, resolve_under
from lmforge.web.registry import pages


def plotly_js() -> Path:
    """``plotly.min.js`` of the installed ``plotly`` package (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("plotly is not installed: pip install -e . installs it")
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the plotly package carries no plotly.min.js; reinstall plotly")
    return path


def create_app(runs_dir: Path, poll_ms: int = 1000) -> Flask:
    """The app serving ``runs_dir`` (read-only); the dashboard polls running runs every ``poll_ms``.
    UserError for a ``runs_dir`` that is no folder and a ``poll_ms`` under 100."""
    if not Path(runs_dir).is_dir():
        raise UserError(f"RUNS_DIR: {runs_dir} is not a folder; give the folder that holds your run folders")
    if poll_ms < 100:
        raise UserError(f"--poll-ms: {poll_ms} is too small; give at least 100")
    app = Flask(__name__)
    app.config["RUNS_DIR"] = Path(runs_dir).resolve()
    app.config["POLL_MS"] = poll_ms
    found = pages()
    for page in found:
        app.register_blueprint(page.blueprint)
    js = plotly_js()

    @app.context_processor
    def _nav() -> dict:
        return {"nav_pages": found, "runs_dir": str(app.config["RUNS_DIR"]), "poll_ms": poll_ms}

    @app.get("/")
    def index():
        return render_template("index.html", title="Dashboard and planners", pages=found)

    @app.get("/assets/plotly.min.js")
    def plotly_asset():
        return send_file(js, mimetype="text/javascript", max_age=3600)

    @app.get("/files/<path:rel>")
    def run_file(rel: str):
        try:
            path = resolve_under(app.config["RUNS_DIR"], rel)
        except PathRefused:
            abort(403)
        if not path.is_file():
            abort(404)
        return send_file(path, max_age=0)

    return app
