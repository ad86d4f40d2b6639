"""The warm launcher of the multi-process tests (``tests/launcher.py``) gives its ranks what torchrun gives its
workers, and fails a launch as torchrun does; a launch through it is a real multi-process run."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests import torchrun as launchers

PROBE = textwrap.dedent(
    r"""
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    names = sorted(k for k in os.environ if k.split("_")[0] in ("RANK", "LOCAL", "WORLD", "GROUP", "ROLE",
                   "MASTER", "TORCHELASTIC", "TORCH", "OMP"))
    same = {k: os.environ[k] for k in names if k not in ("MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE")}
    line = json.dumps({"rank": dist.get_rank(), "total": total.item(), "env": same, "names": names,
                      "argv": sys.argv[1:], "main": __name__, "threads": torch.get_num_threads(),
                      "cwd": os.getcwd(), "path0": sys.path[0], "session": os.getsid(0) == os.getpid()})
    os.write(1, (line + "\n").encode())  # one write: the ranks share the output file
    rank = dist.get_rank()
    dist.destroy_process_group()
    if len(sys.argv) > 2:  # ARGV[2] = K: rank K fails, the others would wait for two minutes
        if int(sys.argv[2]) == rank:
            sys.exit(3)
        import time
        time.sleep(120)
    """
)


def _ranks(done: subprocess.CompletedProcess) -> dict[int, dict]:
    rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return {r["rank"]: r for r in rows}


@pytest.fixture
def probe(tmp_path: Path) -> str:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def test_warm_ranks_meet_in_one_group_and_a_failed_rank_fails_the_launch(probe):
    """Two forked ranks form one gloo group (their all-reduce sums both), each runs the script as
    ``__main__`` with its arguments, its folder first on ``sys.path`` and a session of its own. When a rank
    exits 3, the launcher stops the rest of the group (SIGTERM: exit -15, instead of their two-minute wait)
    and the launch exits 1 with a line naming each rank's status, as torchrun's ChildFailedError does."""
    done = launchers.torchrun(2, [probe, "x"])
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = _ranks(done)
    assert sorted(ranks) == [0, 1] and all(r["total"] == 3.0 for r in ranks.values())
    assert all(r["argv"] == ["x"] and r["main"] == "__main__" and r["session"] for r in ranks.values())
    assert all(r["path0"] == str(Path(probe).parent) for r in ranks.values())
    failed = launchers.torchrun(2, [probe, "x", "1"])
    assert failed.returncode == 1 and "failed ranks (rank: exit code): {0: -15, 1: 3}" in failed.stderr
    assert sorted(_ranks(failed)) == [0, 1]  # both ran to the end of their work


@pytest.mark.distributed
def test_warm_ranks_get_the_environment_of_torchrun_workers(probe, monkeypatch):
    """A real ``torchrun --standalone`` and the warm launcher start the same script: every launcher variable
    (rank, sizes, master address, elastic and thread settings) is there under both, with the same value
    but for the port, the run id and the error file's path; the same thread count, argv and folder."""
    warm = _ranks(launchers.torchrun(2, [probe, "y"]))
    real = _ranks(launchers.torchrun(2, [probe, "y"], extra=["--max-restarts=0"]))
    assert sorted(warm) == sorted(real) == [0, 1]
    for r in (0, 1):
        assert warm[r]["names"] == real[r]["names"]
        assert warm[r]["env"] == real[r]["env"]
        for key in ("total", "argv", "main", "threads", "cwd", "path0"):
            assert warm[r][key] == real[r][key], key
