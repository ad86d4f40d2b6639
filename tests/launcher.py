"""Multi-process launches for the tests without paying ``import torch`` per rank: a warm launcher.

``torchrun`` starts an agent (an interpreter that imports torch) and one fresh interpreter per rank, each of
which imports torch and lmforge again: 6-12 s of every launch on 2 cores, before the first step. The
distributed set launches about 150 runs. Here one interpreter per test session (the *zygote*) imports
torch and every lmforge module once, then, per launch, forks a store process and one process per rank.
Each rank is a fresh copy of the zygote, made before anything ran: no thread pool, process group,
RNG draw or compiled graph of another launch reaches it. It gets the environment torchrun gives a worker
(the same variables with the same meaning: ``tests/test_launcher.py`` compares them with a real torchrun's;
the launch's own environment, where ``tests/torchrun.py`` starts a new zygote when a variable read at
import changed),
the working folder and ``sys.argv`` of ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``, and runs the
module or script as ``__main__``. As under torchrun, its ranks meet in the launcher's store
(``TORCHELASTIC_USE_AGENT_STORE``), the whole group is stopped when one rank fails, and the launch fails
(exit 1) unless every rank exits 0.

What a fork cannot give, the caller gets from a real torchrun (:func:`tests.torchrun.torchrun` decides):
agent options (``--max-restarts``: the restart test) and environment variables read when a process
starts (glibc reads ``MALLOC_*`` once; a worker that needs one calls ``mallopt`` instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# seconds a failed group's other ranks get after SIGTERM before SIGKILL (torchrun waits 30)
STOP_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redirect(out: str, err: str) -> None:
    """Point file descriptors 0-2 of this (forked) process at /dev/null and the job's output files."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)


def _finish(code: int) -> None:
    """End a forked process as the interpreter ends: non-daemon threads joined, atexit handlers run, stdio
    flushed; never return into the zygote's loop."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # what Py_FinalizeEx does first
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    """The status ``python`` exits with for ``SystemExit(exc.code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _rank(job: dict, env: dict[str, str]) -> None:
    """The body of one forked rank: the job's environment, folder and argv, then its module or script."""
    import runpy

    import torch

    os.setsid()  # as torchrun's workers: a session of their own, so a group stop reaches their children
    _redirect(job["stdout"], job["stderr"])
    os.environ.clear()
    os.environ.update(env)
    os.chdir(job["cwd"])
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    # libgomp read OMP_NUM_THREADS when the zygote loaded it; this rank's value is set as a fresh
    # interpreter would take it
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    args = job["args"]
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]  # runpy sets argv[0] to the module's file
            sys.path[0] = job["cwd"]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    _finish(code)


def _store(port: int, world: int, err: str) -> None:
    """The body of the forked store process: the TCPStore the ranks rendezvous in, as torchrun's agent hosts
    it, until the launcher stops it."""
    import torch.distributed as dist

    _redirect(os.devnull, err)
    store = dist.TCPStore("localhost", port, world, is_master=True, wait_for_workers=False)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while store is not None:
        time.sleep(3600)


_RESULTS_FD = -1  # the zygote's result channel: closed in every forked process


def _fork(body, *args) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            if _RESULTS_FD >= 0:
                os.close(_RESULTS_FD)
            body(*args)
        finally:
            os._exit(1)  # body ends with os._exit; this is only reached if it raised first
    return pid


def _stop(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # the rank and what it started (each rank leads its own session)


def run_job(job: dict) -> dict:
    """Run one launch: ``{"returncode": 0 | 1, "timed_out": bool}``. Rank output goes to the job's files,
    all ranks appending to the same two, as torchrun's workers share its stdout and stderr."""
    nproc, port = job["nproc"], _free_port()
    base = {
        **job["env"],
        "GROUP_RANK": "0",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "localhost",  # as torchrun --standalone
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"launcher-{os.getpid()}-{port}",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": job["env"].get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": job["env"].get(
            "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        ),
    }
    store = _fork(_store, port, nproc, job["stderr"])
    ranks = {}
    for r in range(nproc):
        error_file = str(Path(job["stderr"]).parent / f"error_{r}.json")  # where torch's @record writes
        env = {
            **base,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "ROLE_RANK": str(r),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
        ranks[_fork(_rank, job, env)] = r
    codes: dict[int, int] = {}
    deadline = time.monotonic() + job["timeout"]
    kill_at = None  # after a failure: when the ranks still running get SIGKILL
    timed_out = False
    while len(codes) < nproc:
        for pid in [p for p in ranks if p not in codes]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        left = [p for p in ranks if p not in codes]
        if not left:
            break
        now = time.monotonic()
        if kill_at is None and any(c != 0 for c in codes.values()):  # stop the group, as torchrun does
            _stop(left, signal.SIGTERM)
            kill_at = now + STOP_GRACE_S
        if now > deadline and not timed_out:
            timed_out = True
            _stop(left, signal.SIGKILL)
        elif kill_at is not None and now > kill_at:
            _stop(left, signal.SIGKILL)
            kill_at = float("inf")
        time.sleep(0.005)
    for pid in ranks:  # whatever a rank left behind in its session
        _stop([pid], signal.SIGKILL)
    os.kill(store, signal.SIGTERM)
    os.waitpid(store, 0)
    failures = {ranks[p]: c for p, c in codes.items() if c != 0}
    if failures:
        with open(job["stderr"], "a") as f:
            f.write(f"launcher: failed ranks (rank: exit code): {dict(sorted(failures.items()))}\n")
    return {"returncode": 1 if failures else 0, "timed_out": timed_out}


def preload() -> None:
    """Import torch, its distributed packages and every lmforge module but the web app (Flask, the
    browser's pages): what a rank would import anyway, done once."""
    import importlib
    import pkgutil

    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.pipelining
    import torch.distributed.tensor

    import lmforge

    for mod in pkgutil.walk_packages(lmforge.__path__, "lmforge."):
        if not mod.name.startswith("lmforge.web"):
            importlib.import_module(mod.name)
    torch.set_num_threads(1)


def serve() -> None:
    """The zygote: preload, say ``ready``, then one JSON job per line of stdin, one JSON result per line of
    stdout, until stdin closes."""
    global _RESULTS_FD
    _RESULTS_FD = os.dup(1)
    out = os.fdopen(_RESULTS_FD, "w", buffering=1)
    os.dup2(2, 1)  # nothing the imports print may reach the result channel
    preload()
    out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        out.write(json.dumps(run_job(json.loads(line))) + "\n")


class Zygote:
    """The client side: a zygote started with a given environment, launches sent to it one at a time."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"the test launcher did not start (exit {self.proc.poll()})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def launch(
        self, nproc: int, args: list[str], timeout: float, folder: Path, env: dict[str, str]
    ) -> subprocess.CompletedProcess:
        out, err = folder / "stdout", folder / "stderr"
        out.write_text(""), err.write_text("")
        job = {
            "nproc": nproc,
            "args": list(args),
            "env": env,
            "cwd": os.getcwd(),
            "stdout": str(out),
            "stderr": str(err),
            "timeout": timeout,
        }
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test launcher died during a launch")
        result = json.loads(line)
        cmd = ["launcher", f"--nproc-per-node={nproc}", *args]
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, result["returncode"], stdout, stderr)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve()
