"""Where pipeline tasks run: this process, worker processes on this machine, or a Ray cluster.

A task is a module-level function and small picklable arguments (the output folder, pass, shard); it
reads and writes files under the output folder and returns nothing, so every executor produces the same
files. Ray workers therefore need the output folder on a filesystem they share with the driver (a
local Ray instance always does).
"""

from __future__ import annotations

import abc
import logging
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any

from lmforge.errors import UserError

log = logging.getLogger(__name__)

Task = Callable[..., None]


def default_workers() -> int:
    """Cores this process may use (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


WORKERS_ENV = "LMFORGE_DATA_WORKERS"  # set in each local worker process: how many share the machine


def threads_per_worker() -> int:
    """Threads a stage of this process may run (torch's intra-op pool): the usable cores divided among the
    local executor's worker processes; else ``OMP_NUM_THREADS`` where set (Ray sets it per task); else
    every usable core (one process)."""
    if os.environ.get(WORKERS_ENV):
        return max(1, default_workers() // int(os.environ[WORKERS_ENV]))
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return default_workers()


def _worker_start(workers: int) -> None:
    os.environ[WORKERS_ENV] = str(workers)


class Executor(abc.ABC):
    """Runs a batch of tasks to completion (a failing task stops the batch with its exception)."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def run(self, fn: Task, args: Sequence[tuple[Any, ...]]) -> None:
        """Call ``fn(*a)`` for every ``a`` in ``args``; return when all have finished."""

    def close(self) -> None:  # noqa: B027 - executors without resources keep this no-op
        """Release workers (process pools, a Ray connection); a no-op for executors that hold none."""


class InlineExecutor(Executor):
    """One worker: tasks run in this process, in order."""

    def run(self, fn: Task, args: Sequence[tuple[Any, ...]]) -> None:
        for a in args:
            fn(*a)


class LocalExecutor(Executor):
    """Worker processes on this machine (started with ``spawn``: no inherited threads or locks)."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def run(self, fn: Task, args: Sequence[tuple[Any, ...]]) -> None:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_worker_start, initargs=(self.workers,)
            )
        futures = [self._pool.submit(fn, *a) for a in args]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in done:
            f.result()  # re-raises a task's exception here

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class RayExecutor(Executor):
    """Tasks on Ray: the cluster at ``RAY_ADDRESS`` if set, else a local instance of ``workers`` CPUs."""

    def __init__(self, workers: int):
        try:
            import ray
        except ImportError:
            raise UserError("--executor ray: ray is not installed; pip install 'ray>=2.40'") from None
        self.ray = ray
        self._started = False
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS"):
                ray.init(log_to_driver=False)
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
            self._started = True
        self._remote: dict[Task, Any] = {}

    def run(self, fn: Task, args: Sequence[tuple[Any, ...]]) -> None:
        remote = self._remote.get(fn)
        if remote is None:
            remote = self._remote[fn] = self.ray.remote(num_cpus=1, max_retries=2)(fn)
        self.ray.get([remote.remote(*a) for a in args])

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
            self._started = False


def make_executor(kind: str, workers: int = 0) -> Executor:
    """``local`` (processes; inline when one worker) or ``ray``; ``workers`` 0 means every usable core."""
    n = workers or default_workers()
    if kind == "ray":
        return RayExecutor(n)
    if kind != "local":
        raise UserError(f"--executor {kind}: unknown executor; use local or ray")
    log.info("data: %d worker process%s", n, "" if n == 1 else "es")
    return InlineExecutor() if n == 1 else LocalExecutor(n)
