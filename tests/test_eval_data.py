"""``lmforge eval RUN --data FILES``: files are tokenised as training stores documents, scored on the
validation windows by the same code as the run's evaluation, and the loss is the mean token
cross-entropy of the model computed by hand on the same windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.cli import main
from lmforge.config import SourceConfig
from lmforge.data.loader import TokenStream
from lmforge.data.prepare import prepare_data
from lmforge.data.shards import Shard
from lmforge.data.sources import is_validation, read_source
from lmforge.evaluate.files import score, tokenize_file
from lmforge.evaluate.run_loading import evaluate_run, load_run
from lmforge.model.loss import NextTokenLoss
from lmforge.precision import PrecisionPolicy
from lmforge.recipe import load_config
from lmforge.train.launch import train
from tests.conftest import tiny_overrides

CPU = torch.device("cpu")
SEQ = 32  # tiny_overrides' data.seq_len


@pytest.fixture(autouse=True)
def _cli_logging(cli_logging):
    """Tests here run the CLI in this process."""


@pytest.fixture(scope="module")
def run(corpus_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_data")
    over = tiny_overrides(corpus_dir, root / "data") | {"train.steps": 10, "train.sample_tokens": 0}
    train(load_config(None, over), root / "run", progress_bar=False)
    return root / "run"


@pytest.fixture(scope="module")
def val_file(run, corpus_dir, tmp_path_factory) -> Path:
    """The first validation documents of the run's corpus (about 1,000 tokens), in the split's order."""
    docs = [
        d
        for d in read_source(SourceConfig(path=str(corpus_dir / "stdlib.jsonl")))
        if is_validation(d.id, 0.1)
    ]
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    chars, kept = 0, []
    for d in docs:
        kept.append(json.dumps({"id": d.id, "text": d.text}))
        chars += len(d.text)
        if chars > 2000:
            break
    path.write_text("\n".join(kept) + "\n")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_a_file_of_validation_text_gives_the_validation_tokens_and_the_evaluation_loss(run, val_file):
    cfg, tok, model, _ = load_run(run, CPU)
    ft = tokenize_file(val_file, tok)
    val = TokenStream(prepare_data(cfg.data).val)
    assert np.array_equal(ft.tokens, val.tokens(0, len(ft.tokens)))  # training's reader and tokenisation
    full = (len(ft.tokens) - 1) // SEQ
    assert full >= 5
    # the full windows, scored by eval --data's code, are the run's evaluation of as many tokens
    cut = TokenStream([Shard(ft.tokens[: full * SEQ + 1], ft.offsets)])
    precision = PrecisionPolicy.resolve("fp32", CPU)
    loss_sum, n = score(NextTokenLoss(model, cfg.train.loss_chunk), cut, SEQ, 4, precision)
    assert n == full * SEQ
    # the same FP32 windows scored by two callers: measured equal; 1e-6 is 8 FP32 ulps of room
    assert loss_sum / n == pytest.approx(evaluate_run(run, CPU, full * SEQ)["val_loss"], rel=1e-6)


def _hand_loss(model, tokens: np.ndarray, offsets: np.ndarray) -> float:
    """Mean cross-entropy of the model's logits on windows of SEQ + 1 tokens at stride SEQ, then the rest;
    attention within documents (a token's document: the last offset at or before it)."""
    model.eval()
    doc = torch.tensor(np.searchsorted(offsets, np.arange(len(tokens)), side="right") - 1)
    t = torch.tensor(tokens)
    full = (len(tokens) - 1) // SEQ * SEQ
    parts = [(t[:full].view(-1, SEQ), t[1 : full + 1].view(-1, SEQ), doc[:full].view(-1, SEQ))]
    if full < len(tokens) - 1:
        parts.append((t[full:-1][None], t[full + 1 :][None], doc[full:-1][None]))
    losses = []
    with torch.no_grad():
        for x, y, d in parts:
            logits = model.logits(model(x, d))
            losses.append(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none"))
    return float(torch.cat(losses).double().mean())


def test_eval_data_loss_is_the_mean_token_cross_entropy(run, val_file, tmp_path, capsys):
    text = tmp_path / "one.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 6)
    code, out, err = run_cli(capsys, "eval", str(run), "--data", str(val_file), str(text), "--json")
    assert code == 0, err
    result = json.loads(out)
    _, tok, model, _ = load_run(run, CPU)
    total, count = 0.0, 0
    for row, path in zip(result["files"], (val_file, text), strict=True):
        ft = tokenize_file(path, tok)
        assert row["tokens"] == len(ft.tokens) and row["targets"] == len(ft.tokens) - 1
        # FP32 token losses summed in other groupings (windows, then float64 here): measured 4e-8 relative;
        # 1e-5 is the worst case of an FP32 sum of ~170 terms (170 u, u = 6e-8)
        assert row["loss"] == pytest.approx(_hand_loss(model, ft.tokens, ft.offsets), rel=1e-5)
        # default approx: float64 exp of the same logged loss (rounding only)
        assert row["ppl"] == pytest.approx(np.exp(row["loss"]))
        total, count = total + row["loss"] * row["targets"], count + row["targets"]
    assert result["files"][1]["documents"] == 1  # a text file is one document
    assert result["files"][1]["tokens"] == 1 + len(tok.encode(text.read_text()))
    assert result["loss"] == pytest.approx(total / count, rel=1e-9)  # float64 means: 1.5e-16 measured
    code, out, _ = run_cli(capsys, "eval", str(run), "--data", str(text))
    assert code == 0 and out.splitlines()[-1].split()[0] == "overall"


@pytest.mark.parametrize(
    ("name", "says"), [("missing.txt", "no such file"), ("notes.csv", "not a .txt, .jsonl")]
)
def test_a_bad_data_file_is_one_line_exit_2(run, tmp_path, capsys, name, says):
    (tmp_path / "notes.csv").write_text("a,b\n")
    code, out, err = run_cli(capsys, "eval", str(run), "--data", str(tmp_path / name))
    assert code == 2 and out == "" and err.count("\n") == 1 and says in err and name in err
