"""Whole text and HTML files that are not UTF-8: the encoding is detected before a file is dropped as
``read.invalid_utf8``, the conversion is counted, and binary files are still dropped with their reason."""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.corpus import readers
from lmforge.corpus.config import build_pipeline_config
from lmforge.corpus.document import Drop
from lmforge.corpus.pipeline import run_pipeline

# written by hand in ISO-8859-1 (Latin-1): each accented letter one byte, no <meta charset>
FRENCH = (
    "<html><head><title>Le café</title></head><body><p>Le garçon a mangé une crème brûlée à l'hôtel "
    "près de la forêt. Ça coûte très cher, dit-il, déçu.</p></body></html>"
)
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))


def _read(path: Path):
    (out,) = readers.read_piece(
        readers.Piece(0, 0, str(path), readers.detect_format(path)), readers.ReadOptions()
    )
    return out


def test_an_undeclared_latin1_page_is_decoded_and_marked(tmp_path):
    (tmp_path / "page.html").write_bytes(FRENCH.encode("latin-1"))
    doc = _read(tmp_path / "page.html")
    assert doc.text == FRENCH and doc.meta == {"format": "html", "encoding": "cp1252"}
    (tmp_path / "notes.txt").write_bytes("Größere Übungen für Bären: schön, müde.\n".encode("latin-1"))
    assert _read(tmp_path / "notes.txt").text == "Größere Übungen für Bären: schön, müde.\n"
    (tmp_path / "utf8.html").write_text(FRENCH, encoding="utf-8")
    assert _read(tmp_path / "utf8.html").meta == {"format": "html"}  # UTF-8: nothing converted


def test_binary_and_undecodable_files_are_still_dropped(tmp_path):
    (tmp_path / "image.html").write_bytes(PNG)
    assert _read(tmp_path / "image.html")[1] == Drop("read.binary")
    # bytes that are no text in any encoding (every byte value but NUL, twice, shuffled by a fixed rule)
    noise = bytes((i * 167 + 13) % 255 + 1 for i in range(4096))
    (tmp_path / "noise.txt").write_bytes(noise)
    assert _read(tmp_path / "noise.txt")[1] == Drop("read.invalid_utf8")
    # UTF-8 with one damaged byte is damaged UTF-8, not Latin-1 text
    (tmp_path / "damaged.txt").write_bytes("café crème brûlée".encode() + b"\xff")
    assert _read(tmp_path / "damaged.txt")[1] == Drop("read.invalid_utf8")


def test_lmforge_data_keeps_the_page_and_counts_the_conversion(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "latin1.html").write_bytes(FRENCH.encode("latin-1"))
    (src / "utf8.html").write_text(FRENCH.replace("café", "thé"), encoding="utf-8")
    (src / "image.html").write_bytes(PNG)
    cfg = build_pipeline_config(
        {
            "sources": [{"path": str(src)}],
            "stages": [{"name": "extract"}],
            "output": {"compression": "none"},
            "tokenize": {"vocab_size": 300, "val_fraction": 0.1},
        }
    )
    report = run_pipeline(cfg, tmp_path / "out", workers=1)
    kept = [json.loads(x) for p in sorted((tmp_path / "out" / "kept").glob("*.jsonl")) for x in p.open()]
    by_id = {Path(r["id"]).name: r for r in kept}
    assert set(by_id) == {"latin1.html", "utf8.html"}
    assert "Le garçon a mangé une crème brûlée à l'hôtel" in by_id["latin1.html"]["text"]
    assert by_id["latin1.html"]["meta"]["encoding"] == "cp1252"
    assert report["meta"]["read.decoded_cp1252"] == 1
    assert report["removed"] == {"read.binary": 1}
    assert report["documents"] == {"input": 3, "kept": 2, "removed": 1}  # every input accounted for
