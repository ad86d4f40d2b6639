"""Serving the app: ``lmforge dashboard`` (until Ctrl-C) and, for tests, in a background thread."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flask import Flask
from werkzeug.serving import BaseWSGIServer, WSGIRequestHandler, make_server

from lmforge.errors import UserError


def on_terminal() -> bool:
    """Whether both stdout and stderr (where the request log goes) are terminals: colour only then."""
    return all(stream is not None and stream.isatty() for stream in (sys.stdout, sys.stderr))


class RequestHandler(WSGIRequestHandler):
    """werkzeug's handler, whose request log colours its lines by status code with ANSI escapes: those
    only on a terminal, plain lines into a pipe or a file."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if on_terminal():
            super().log_request(code, size)
        else:
            self.log("info", '"%s" %s %s', self.requestline.translate(self._control_char_table), code, size)


def bind(app: Flask, host: str, port: int) -> BaseWSGIServer:
    """A threaded WSGI server for ``app`` on ``host:port`` (port 0: a free one); UserError when the address
    cannot be bound (out of range, in use, not this machine's)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port: {port} is out of range; give 0..65535 (0: any free port)")
    try:
        with socket.create_server((host, port)):  # werkzeug would print and exit on a port in use
            pass
    except OSError as exc:
        raise UserError(
            f"--port/--host: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port"
        ) from None
    return make_server(host, port, app, threaded=True, request_handler=RequestHandler)


def url_of(server: BaseWSGIServer) -> str:
    """The server's base URL."""
    host = server.host if ":" not in server.host else f"[{server.host}]"
    return f"http://{host}:{server.port}"


@contextmanager
def running(app: Flask, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` in a daemon thread for the ``with`` block; yields the base URL."""
    server = bind(app, host, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield url_of(server)
    finally:
        server.shutdown()
        thread.join(timeout=10)
