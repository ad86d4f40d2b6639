"""The combination matrix's layouts (``tests/combinations.py``: ``LAYOUTS``): DDP, FSDP2, tensor, pipeline
and expert parallelism, each alone and with every feature of the single-process matrix, two processes
under torchrun (gloo). A row trains two steps and passes :func:`tests.combinations.check` on every rank's
own parts of the model (shards, stages), or is refused before any work in one line naming both keys,
exactly as ``REFUSED`` lists. One launch per layout runs all its rows in turn
(``tests/distributed/combinations_worker.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.train.resume import config_text
from tests import combinations as matrix
from tests.test_combinations import make_bases, prepare_combo
from tests.torchrun import torchrun, worker

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def bases(corpus_dir, tmp_path_factory) -> dict[str, Path]:
    return make_bases(corpus_dir, tmp_path_factory.mktemp("bases"))


@pytest.mark.parametrize("layout", [f.name for f in matrix.LAYOUTS])
def test_layout_combinations_work_or_are_refused(layout, corpus_dir, bases, tmp_path):
    """Every row of ``layout``: works (checked on each rank) or is refused exactly when ``REFUSED`` says."""
    rows, results = [], {}
    for combo in matrix.layout_pairs(layout):
        name = "+".join(combo)
        root = tmp_path / name
        root.mkdir()
        cfg, resume, message = prepare_combo(combo, root, corpus_dir, bases, bases["dense"].parent / "data")
        if message is not None:
            results[name] = {"refused": message}
            continue
        (root / "config.toml").write_text(config_text(cfg, []))
        rows.append(
            {
                "name": name,
                "run_dir": str(root / "run"),
                "resume": resume,
                "config": str(root / "config.toml"),
            }
        )
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    done = torchrun(2, [worker("combinations_worker.py"), str(tmp_path / "rows.json")], timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    for row in rows:
        ranks = [json.loads((Path(row["run_dir"]) / f"check_rank_{r}.json").read_text()) for r in (0, 1)]
        refused = [r["refused"] for r in ranks if "refused" in r]
        results[row["name"]] = (
            {"refused": refused[0]} if refused else {"problems": [x for r in ranks for x in r["problems"]]}
        )
    wrong = {}
    for combo in matrix.layout_pairs(layout):
        name, got, why = "+".join(combo), results["+".join(combo)], matrix.refusal(combo)
        if why is None and "refused" in got:
            wrong[name] = f"refused: {got['refused']}"
        elif why is None and got["problems"]:
            wrong[name] = got["problems"]
        elif why is not None and "refused" not in got:
            wrong[name] = f"trained; REFUSED says: {why}"
        elif why is not None and not (
            "\n" not in got["refused"]
            and all(k in got["refused"] for k in matrix.keys(matrix.refused_pair(combo)))
        ):
            wrong[name] = f"refusal does not name both keys: {got['refused']}"
    assert not wrong, json.dumps(wrong, indent=1)
