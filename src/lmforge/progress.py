"""What a long phase shows while it works: one reporter for every phase longer than a few seconds.

:class:`Progress` counts ``done`` of ``total`` (documents, pairs, levels) and shows the share done,
the rate and the time left: on a terminal a bar redrawn in place on stderr; otherwise (piped, ``nohup``,
a scheduler's log) a log line at most every ``every`` seconds, so a log never stays silent for long and
never fills with redraws. The phase opens with a line saying what it does and, when it took ``every``
seconds or more, closes with one saying how long it took.

A phase that cannot count (a blocking call: compiling a model, training a tokenizer inside a library)
gives ``expected_s`` instead of ``total`` when it has an honest figure (then the time left is that
figure less the time spent) and runs under :meth:`Progress.ticking`, a daemon thread that keeps the
bar or the lines going until the call returns.

Lines go to the ``lmforge.progress`` logger (so they carry the time, and under ``torchrun`` only rank 0
shows them); the bar is drawn only where that logger shows INFO and stderr is a terminal. The clock is
injected (``clock``), so what is shown when is a pure function of the calls and the clock's readings.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

log = logging.getLogger("lmforge.progress")

EVERY_S = 5.0  # piped: at most one line per this many seconds
BAR_EVERY_S = 0.2  # terminal: at most one redraw per this many seconds
BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m"``, ``125`` -> ``"2m05s"``, ``7`` -> ``"7s"``."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _count(n: float) -> str:
    return f"{n:,.0f}" if n == int(n) else f"{n:,.1f}"


class Progress:
    """``done`` of ``total`` ``unit`` for the phase ``what``; use as a context manager (or call
    :meth:`close`). ``tty``: draw a bar (default: stderr is a terminal and INFO is shown); ``emit``: where
    lines go (default: the ``lmforge.progress`` logger's INFO); ``stream``: where the bar goes."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        unit: str = "",
        *,
        expected_s: float | None = None,
        every: float = EVERY_S,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] | None = None,
        stream: TextIO | None = None,
        opening: str | None = None,
    ):
        self.what, self.total, self.unit = what, total, unit
        self.expected_s, self.every, self.clock = expected_s, every, clock
        self.emit = emit or log.info
        self.stream = stream or sys.stderr
        if tty is None:
            tty = log.isEnabledFor(logging.INFO) and self.stream.isatty()
        self.tty = tty
        self.done = 0.0
        self.start = self.last = clock()
        self.lines = 0  # progress lines shown (piped), the opening and closing ones excepted
        self.closed = False
        self._lock = threading.Lock()
        self._ticker: tuple[threading.Event, threading.Thread] | None = None
        opening = self._opening() if opening is None else opening
        if opening:  # "" opens silently: a phase that is shown only once it has lasted ``every`` seconds
            self.emit(opening)

    def _opening(self) -> str:
        if self.total is not None:
            return f"{self.what}: {_count(self.total)} {self.unit}".rstrip()
        if self.expected_s is not None:
            return f"{self.what}, about {format_duration(self.expected_s)}"
        return f"{self.what}"

    # -- what the phase calls -----------------------------------------------------------------------

    def update(self, n: float = 1) -> None:
        """``n`` more done; shows a line or redraws the bar when it is time."""
        with self._lock:
            self.done += n
            self._show(self.clock())

    def tick(self) -> None:
        """Nothing more done, but time passed: show a line or redraw the bar when it is time (the
        ticking thread calls this)."""
        with self._lock:
            self._show(self.clock())

    def close(self) -> None:
        """End the phase: stop ticking, clear the bar; when it took ``every`` seconds or more, a closing
        line."""
        self.stop_ticking()
        with self._lock:
            if self.closed:
                return
            self.closed = True
            now = self.clock()
            if self.tty:
                self.stream.write("\r\033[K")
                self.stream.flush()
            if now - self.start >= self.every or self.lines:
                self.emit(self.closing(now))

    def abandon(self) -> None:
        """End the phase without saying it is done (it failed, or the run stops before it ended)."""
        self.stop_ticking()
        with self._lock:
            if not self.closed and self.tty:
                self.stream.write("\r\033[K")
                self.stream.flush()
            self.closed = True

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    def start_ticking(self, interval: float = 1.0, poll: Callable[[], float] | None = None) -> None:
        """Keep the phase visible while a blocking call runs: a daemon thread calls :meth:`tick` every
        ``interval`` seconds until :meth:`stop_ticking` or :meth:`close`; with ``poll``, the count done
        is read from it first (work done elsewhere: worker processes' finished shards)."""
        self.stop_ticking()
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval):
                if poll is not None:
                    with self._lock:
                        self.done = poll()
                self.tick()

        self._ticker = (stop, threading.Thread(target=run, name=f"progress: {self.what}", daemon=True))
        self._ticker[1].start()

    def stop_ticking(self) -> None:
        if self._ticker is not None:
            stop, thread = self._ticker
            stop.set()
            thread.join()
            self._ticker = None

    @contextmanager
    def ticking(self, interval: float = 1.0, poll: Callable[[], float] | None = None) -> Iterator[Progress]:
        """:meth:`start_ticking` for the time of a ``with`` block."""
        self.start_ticking(interval, poll)
        try:
            yield self
        finally:
            self.stop_ticking()

    # -- what is shown --------------------------------------------------------------------------------

    def _show(self, now: float) -> None:
        if self.closed:
            return
        if self.tty:
            if now - self.last >= BAR_EVERY_S:
                self.last = now
                self.stream.write("\r\033[K" + self.bar(now))
                self.stream.flush()
        elif now - self.last >= self.every:
            self.last = now
            self.lines += 1
            self.emit(self.line(now))

    def status(self, now: float) -> str:
        """``1,200/6,205 pairs (19%), 16.7 pairs/s, about 5m00s left`` (or, without a total, the time
        spent and, with ``expected_s``, the time left)."""
        spent = now - self.start
        if self.total is None:
            text = f"{format_duration(spent)} so far"
            if self.done:
                text += f", {_count(self.done)} {self.unit}".rstrip()
            if self.expected_s is not None:
                left = self.expected_s - spent
                text += (
                    f", about {format_duration(left)} left" if left >= 1 else ", taking longer than expected"
                )
            return text
        share = self.done / self.total if self.total else 1.0
        text = f"{_count(self.done)}/{_count(self.total)} {self.unit}".rstrip() + f" ({100 * share:.0f}%)"
        if self.done and spent > 0:
            rate = self.done / spent
            text += f", {rate:,.3g} {self.unit or 'items'}/s"
            text += f", about {format_duration((self.total - self.done) / rate)} left"
        return text

    def line(self, now: float) -> str:
        return f"{self.what}: {self.status(now)}"

    def bar(self, now: float) -> str:
        """One terminal line: the bar (filled by share done, or by time spent against ``expected_s``)
        and the status."""
        if self.total:
            share = self.done / self.total
        elif self.expected_s:
            share = (now - self.start) / self.expected_s
        else:
            share = 0.0
        filled = round(BAR_WIDTH * min(max(share, 0.0), 1.0))
        return f"{self.what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.status(now)}"

    def closing(self, now: float) -> str:
        spent = now - self.start
        text = f"{self.what}: done in {format_duration(spent)}"
        if self.done and spent > 0:
            text += f" ({_count(self.done)} {self.unit}".rstrip() + f", {self.done / spent:,.3g}/s)"
        return text
