"""Worker: the combination matrix's rows of one layout, one run after another in the same processes.

    torchrun --nproc-per-node=2 combinations_worker.py ROWS.json

``ROWS.json``: a list of ``{"name", "run_dir", "resume", "config"}`` (``config``: a recipe file, the
run's config; ``resume``: a post-training run started by the test, ``start`` having written its step 0).
Each row trains with :class:`tests.combinations.Probe` and each rank writes what
:func:`tests.combinations.check` finds wrong on its own parts of the model (FSDP2's and tensor
parallelism's shards, a pipeline stage's layers) to ``RUN_DIR/check_rank_K.json``: ``{"problems": [...]}``,
or ``{"refused": message}`` when the run was refused.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(
    0, str(REPO)
)  # the matrix's lists and checks live in tests/ (torchrun puts only src/ on the path)

from lmforge.errors import UserError  # noqa: E402
from lmforge.recipe import load_config  # noqa: E402
from lmforge.train.launch import train  # noqa: E402
from tests import combinations as matrix  # noqa: E402


def main(rows_file: str) -> None:
    rank = int(os.environ["RANK"])
    rows = json.loads(Path(rows_file).read_text())
    for i, row in enumerate(rows):
        # each run makes and ends its own process group in the agent's store, under a prefix named by this
        # variable (parallel/layout.py::start_process_group): a fresh one for each run, as for a restart
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(1000 + i)
        combo = tuple(row["name"].split("+"))
        run_dir = Path(row["run_dir"])
        probe = matrix.Probe()
        try:
            train(
                load_config(Path(row["config"])),
                run_dir,
                resume=row["resume"],
                callbacks=[probe],
                progress_bar=False,
            )
            found = {"problems": matrix.check(combo, probe)}
        except UserError as e:
            found = {"refused": str(e)}
        except Exception as e:
            found = {"problems": [f"raised {type(e).__name__}: {e}"]}
            print(f"row {row['name']}: {traceback.format_exc()}", file=sys.stderr, flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / f"check_rank_{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
