"""The planner's stated accuracy as the memory pages show it (``web/accuracy.py``): read from the accuracy
matrix ``plan/accuracy.py::load_accuracy`` finds, with texts worked out by hand from the figures of
``tests/accuracy_matrix.py``; no matrix means "not measured", never a figure."""

from __future__ import annotations

from pathlib import Path

from lmforge.plan.accuracy import load_accuracy
from lmforge.web.accuracy import planner_accuracy, stated_accuracy
from lmforge.web.app import create_app
from tests.accuracy_matrix import MATRIX, PEAK_TEXT, ROW_TEXTS, install


def test_loader_reads_the_file_beside_it_and_none_without_one(tmp_path: Path, monkeypatch):
    path = install(monkeypatch, tmp_path / "plan", None)
    assert load_accuracy() is None
    install(monkeypatch, tmp_path / "plan")
    assert path.is_file() and load_accuracy() == MATRIX


def test_stated_accuracy_of_a_matrix():
    acc = stated_accuracy(MATRIX)
    assert acc["measured"] and acc["peak_text"] == PEAK_TEXT
    assert (acc["cases"], acc["within_tolerance"], acc["max"], acc["median"], acc["p90"]) == (
        26,
        25,
        0.031,
        0.008,
        0.024,
    )
    assert {row: acc["rows"][row]["text"] for row in ROW_TEXTS} == ROW_TEXTS
    assert acc["rows"]["gradients"]["max_bytes"] == 8 and acc["rows"]["parameters"]["max_bytes"] == 0
    assert acc["rows"]["activations"]["cases"] == 0  # a part of the peak: no figure of its own
    assert acc["rows"]["overhead"]["text"].startswith("not measured")


def test_no_matrix_is_not_measured_rather_than_a_figure(tmp_path: Path, monkeypatch):
    install(monkeypatch, tmp_path, None)
    acc = planner_accuracy()
    assert acc == {"measured": False, "peak_text": acc["peak_text"], "rows": {}}
    assert acc["peak_text"].startswith("accuracy not measured")
    assert not any(ch.isdigit() for ch in acc["peak_text"])


def test_the_memory_apis_carry_the_installed_matrix(tmp_path: Path, monkeypatch):
    client = create_app(tmp_path).test_client()
    install(monkeypatch, tmp_path / "plan")
    for url in (
        "/api/memory?model=gpt2-124m",
        "/api/zero?model=gpt2-124m",
        "/api/hybrid?model=llama-7b",
        "/api/checkpointing?layers=4",
    ):
        r = client.get(url)
        assert r.status_code == 200, (url, r.get_json())
        assert r.get_json()["accuracy"]["peak_text"] == PEAK_TEXT, url
    (tmp_path / "plan" / "accuracy.json").unlink()
    assert client.get("/api/memory?model=gpt2-124m").get_json()["accuracy"]["measured"] is False
