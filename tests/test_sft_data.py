"""SFT data: records, the chat template, tokenising, the packing / padding loader and its loss targets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.config import ModelConfig
from lmforge.errors import DataError, UserError
from lmforge.model.loss import NextTokenLoss
from lmforge.posttrain.records import Example, Pair, Turn, read_examples, read_pairs
from lmforge.posttrain.sft_data import SFTLoader, Tokenized, sft_eval_batches, tokenize_examples
from lmforge.posttrain.template import (
    ChatTemplate,
    add_chat_tokens,
    read_template,
    write_template_file,
)
from lmforge.tokenizer import train_tokenizer
from tests.conftest import model_of

WORDS = (
    "the", "model", "reads", "a", "list", "of", "numbers", "and", "returns", "their", "sum", "when", "asked",
    "to", "add", "two", "values", "it", "writes", "code", "that", "prints", "hello", "world", "answer",
    "briefly", "please", "explain", "why", "sorting", "keeps", "equal", "items", "in", "order",
)  # fmt: skip


def _sentence(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    texts = [_sentence(rng, 12) + "\n\n  " + _sentence(rng, 5) for _ in range(200)]
    train_tokenizer(texts, 320, root / "plain" / "tokenizer.json")
    add_chat_tokens(root / "plain" / "tokenizer.json", root / "run" / "tokenizer.json")
    return root


@pytest.fixture(scope="module")
def template(chat_dir) -> ChatTemplate:
    from lmforge.tokenizer import Tokenizer

    return ChatTemplate(Tokenizer(chat_dir / "run" / "tokenizer.json"))


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _examples(n: int, seed: int = 0, lo: int = 2, hi: int = 12) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [
        Example(
            (
                Turn("user", _sentence(rng, int(rng.integers(lo, hi)))),
                Turn("assistant", _sentence(rng, int(rng.integers(lo, hi)))),
            ),
            f"mem:{i + 1}",
        )
        for i in range(n)
    ]


# --- records -------------------------------------------------------------------------------------------


def test_each_sft_format_is_read(tmp_path):
    path = _jsonl(
        tmp_path / "sft.jsonl",
        [
            {"instruction": "Add", "input": "2 and 3", "output": "5"},
            {"instruction": "Say hi", "input": "", "output": "hi"},
            {"messages": [{"role": "system", "content": "S0"}, {"role": "user", "content": "q"},
                          {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
                          {"role": "assistant", "content": "a2"}]},
            {"prompt": "p", "completion": "c"},
        ],
    )  # fmt: skip
    got, bad = read_examples([path], system_prompt="Be brief.")
    assert bad == []
    sys = Turn("system", "Be brief.")
    assert [e.turns for e in got] == [
        (sys, Turn("user", "Add\n\n2 and 3"), Turn("assistant", "5")),
        (sys, Turn("user", "Say hi"), Turn("assistant", "hi")),
        (Turn("system", "S0"), Turn("user", "q"), Turn("assistant", "a"), Turn("user", "q2"),
         Turn("assistant", "a2")),
        (sys, Turn("user", "p"), Turn("assistant", "c")),
    ]  # fmt: skip
    assert [e.source for e in got] == [f"{path}:{i}" for i in range(1, 5)]
    assert read_examples([path])[0][0].turns[0] == Turn("user", "Add\n\n2 and 3")


def test_each_pair_format_is_read(tmp_path):
    user = [{"role": "user", "content": "q"}]
    path = _jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "q", "chosen": "good", "rejected": "bad"},
            {"prompt": user, "chosen": [{"role": "assistant", "content": "good"}],
             "rejected": [{"role": "assistant", "content": "bad"}]},
            {"chosen": [*user, {"role": "assistant", "content": "good"}],
             "rejected": [*user, {"role": "assistant", "content": "bad"}]},
            {"prompt": user, "chosen": [*user, {"role": "assistant", "content": "good"}],
             "rejected": [*user, {"role": "assistant", "content": "bad"}]},
        ],
    )  # fmt: skip
    got, bad = read_pairs([path])
    assert bad == []
    want = Pair((Turn("user", "q"),), (Turn("assistant", "good"),), (Turn("assistant", "bad"),), "")
    assert [(p.prompt, p.chosen, p.rejected) for p in got] == [(want.prompt, want.chosen, want.rejected)] * 4
    assert read_pairs([path], system_prompt="S")[0][0].prompt == (Turn("system", "S"), Turn("user", "q"))


def test_every_bad_record_is_reported_with_file_and_line(tmp_path):
    path = _jsonl(
        tmp_path / "bad.jsonl",
        [
            '{"instruction": "x", "output": ',  # 1
            "[1, 2]",  # 2
            {"instruction": "x"},  # 3
            "",  # 4: blank, not a record
            {"prompt": "p", "completion": "  "},  # 5
            {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},  # 6
            {"messages": [{"role": "user", "content": "q"}]},  # 7
            {"text": "plain"},  # 8
            {"prompt": "p", "completion": "ok"},  # 9: good
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},  # 10
        ],
    )
    got, bad = read_examples([path])
    assert [e.source for e in got] == [f"{path}:9"]
    want = [
        (1, "not JSON"),
        (2, "not an object"),
        (3, "missing field output"),
        (5, "empty response: field completion"),
        (6, "unknown role 'bot' in messages[1].role"),
        (7, "no assistant turn in field messages"),
        (8, "missing field messages, instruction/output or prompt/completion"),
        (10, "missing field messages[0].content"),
    ]
    assert [b.source for b in bad] == [f"{path}:{line}" for line, _ in want]
    for b, (_, reason) in zip(bad, want, strict=True):
        assert reason in b.reason and "\n" not in b.reason


def test_bad_pairs_are_reported(tmp_path):
    path = _jsonl(
        tmp_path / "bad_pairs.jsonl",
        [
            {"prompt": "q", "chosen": "good"},
            {"prompt": "q", "chosen": "", "rejected": "bad"},
            {"prompt": [{"role": "assistant", "content": "hi"}], "chosen": "a", "rejected": "b"},
            {"prompt": "q", "chosen": [{"role": "user", "content": "x"}], "rejected": "b"},
        ],
    )
    got, bad = read_pairs([path])
    assert got == []
    reasons = ["missing field rejected", "empty response: field chosen", "must end with a user turn",
               "field chosen holds a user turn"]  # fmt: skip
    assert [b.source for b in bad] == [f"{path}:{i}" for i in range(1, 5)]
    for b, reason in zip(bad, reasons, strict=True):
        assert reason in b.reason


def test_missing_file_is_a_user_error_naming_the_key(tmp_path):
    with pytest.raises(UserError, match=r"^posttrain\.val_files: .*nope\.jsonl"):
        read_examples([tmp_path / "nope.jsonl"], key="posttrain.val_files")
    with pytest.raises(UserError, match=r"^posttrain\.train_files: "):
        read_pairs([tmp_path / "nope.jsonl"])


# --- template ------------------------------------------------------------------------------------------


def test_chat_tokens_are_added_once(chat_dir, tmp_path):
    from lmforge.tokenizer import Tokenizer

    plain = Tokenizer(chat_dir / "plain" / "tokenizer.json")
    with pytest.raises(UserError, match="lacks the chat tokens"):
        ChatTemplate(plain)
    once = (chat_dir / "run" / "tokenizer.json").read_bytes()
    again = add_chat_tokens(chat_dir / "run" / "tokenizer.json", tmp_path / "tokenizer.json")
    assert again.path.read_bytes() == once
    assert again.vocab_size == plain.vocab_size + 4
    t = ChatTemplate(again)
    assert sorted(t.token_ids.values()) == list(range(plain.vocab_size, plain.vocab_size + 4))


def test_render_masks_exactly_the_responses(template):
    turns = (Turn("system", "be brief"), Turn("user", "add two values"), Turn("assistant", "the sum"),
             Turn("user", "why"), Turn("assistant", "it writes code"))  # fmt: skip
    ids, mask = template.render(turns)
    tok = template.tokenizer
    assert ids[0] == tok.eot_id and len(ids) == len(mask)
    assert tok.decode(ids) == (
        "<|endoftext|><|system|>\nbe brief<|end|>\n<|user|>\nadd two values<|end|>\n<|assistant|>\nthe sum"
        "<|end|>\n<|user|>\nwhy<|end|>\n<|assistant|>\nit writes code<|end|>\n"
    )
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(learned) == "the sum<|end|>it writes code<|end|>"
    prompt = template.prompt_ids(turns[:4])
    assert ids[: len(prompt)] == prompt
    assert template.end_id == template.token_ids["<|end|>"]
    assert template.decode_response(ids[len(prompt) :]) == "it writes code"


MARKED = (
    Turn("system", "answer after <|assistant|> only"),
    Turn("user", "say <|end|><|assistant|> then <|endoftext|>, and <|end|>x"),
    Turn("assistant", "no <|end|> here"),
)


def test_marker_text_inside_a_record_is_the_marker(template):
    """A marker's text inside a content is the marker's id (as apply_chat_template reads it), and inside an
    assistant's content it is learned like the rest of the content."""
    ids, mask = template.render(MARKED)
    assert ids.count(template.end_id) == 3 + 3 and ids.count(template.role_ids["assistant"]) == 2 + 1
    assert ids.count(template.bos_id) == 2
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    assert template.tokenizer.decode(learned) == "no <|end|> here<|end|>"


def test_exported_template_tokenizes_marker_text_as_lmforge_does(template, tmp_path):
    """``AutoTokenizer`` over the exported tokenizer files (``hf/files.py``) and ``apply_chat_template``
    give lmforge's ids for a chat whose contents hold every marker's text."""
    transformers = pytest.importorskip("transformers")
    from lmforge.hf.files import write_tokenizer

    write_tokenizer(tmp_path, template.tokenizer.path, 256, template.jinja())
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": t.role, "content": t.content} for t in MARKED]
    kw = {"tokenize": True, "return_dict": False}
    assert hf.apply_chat_template(messages, **kw) == template.render(MARKED)[0]
    assert hf.apply_chat_template(messages[:2], add_generation_prompt=True, **kw) == template.prompt_ids(
        MARKED[:2]
    )


def test_template_file_marks_a_chat_run(chat_dir, tmp_path):
    assert read_template(chat_dir / "plain") is None
    path = write_template_file(chat_dir / "run")
    assert json.loads(path.read_text())["format"] == "lmforge-chat-1"
    back = read_template(chat_dir / "run")
    assert back is not None and back.end_id == ChatTemplate(back.tokenizer).end_id
    (tmp_path / "tokenizer.json").write_bytes((chat_dir / "plain" / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.json").write_text(path.read_text())
    with pytest.raises(UserError, match="lacks the chat tokens"):
        read_template(tmp_path)


ROLES_5 = ("system", "user", "assistant", "user", "assistant")


def test_jinja_template_gives_the_same_ids(template):
    jinja2 = pytest.importorskip("jinja2")
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(template.tokenizer.path))  # as a Hugging Face tokenizer reads it
    rng = np.random.default_rng(1)
    jt = jinja2.Environment().from_string(template.jinja())
    for contents in (["be brief", "add two", "\n\n  code here", " leading space", "why\n"],
                     [_sentence(rng, 9) for _ in range(5)]):  # fmt: skip
        turns = [Turn(r, c) for r, c in zip(ROLES_5, contents, strict=True)]
        msgs = [{"role": t.role, "content": t.content} for t in turns]
        text = jt.render(messages=msgs, add_generation_prompt=False)
        assert hf.encode(text, add_special_tokens=False).ids == template.render(turns)[0]
        text = jt.render(messages=msgs[:4], add_generation_prompt=True)
        assert hf.encode(text, add_special_tokens=False).ids == template.prompt_ids(turns[:4])


# --- tokenising and rows --------------------------------------------------------------------------------


def test_over_length_skip_and_truncate(template):
    short, long = (
        _examples(2, seed=3, lo=3, hi=4)[0],
        Example((Turn("user", "q"), Turn("assistant", _sentence(np.random.default_rng(2), 60))), "f.jsonl:7"),
    )
    n = len(template.render(long.turns)[0])
    seq_len = n - 6
    got, bad = tokenize_examples([short, long], template, seq_len, "skip")
    assert [t.source for t in got] == ["mem:1"]
    assert len(bad) == 1 and bad[0].source == "f.jsonl:7"
    assert f"over the length limit: {n} tokens > data.seq_len + 1 = {seq_len + 1}" in bad[0].reason
    got, bad = tokenize_examples([short, long], template, seq_len, "truncate")
    assert bad == [] and len(got[1].ids) == seq_len + 1
    full_ids, full_mask = template.render(long.turns)
    assert got[1].ids.tolist() == full_ids[: seq_len + 1] and got[1].mask.tolist() == full_mask[: seq_len + 1]
    got, bad = tokenize_examples([long], template, 4, "truncate")  # no response token left
    assert got == [] and "no response token" in bad[0].reason


def _same_length_prompts(template) -> tuple[str, str]:
    """Two different user texts that render to the same number of ids."""
    by_len: dict[int, str] = {}
    for w in WORDS:
        n = len(template.render((Turn("user", f"please {w}"), Turn("assistant", "ok")))[0])
        if n in by_len and by_len[n] != f"please {w}":
            return by_len[n], f"please {w}"
        by_len[n] = f"please {w}"
    raise AssertionError("no two prompts of the same length")


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_changing_a_prompt_changes_no_label(template, packing):
    a, b = _same_length_prompts(template)
    rest = _examples(9, seed=4)

    def batches(prompt: str) -> list:
        first = Example((Turn("user", prompt), Turn("assistant", "the sum of two values")), "mem:0")
        toks, bad = tokenize_examples([first, *rest], template, 96, "skip")
        assert bad == []
        loader = SFTLoader(toks, 96, 2, seed=5, packing=packing)
        return [loader.next_batch() for _ in range(8)]

    xa, xb = batches(a), batches(b)
    assert any(not torch.equal(p.inputs, q.inputs) for p, q in zip(xa, xb, strict=True))
    for p, q in zip(xa, xb, strict=True):
        assert torch.equal(p.targets, q.targets) and torch.equal(p.doc_ids, q.doc_ids)


def _tiny_model(vocab: int, seq_len: int):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4)
    return model_of(cfg, vocab, seq_len).eval()


def test_loss_equals_hand_computation_over_response_tokens(template):
    toks, _ = tokenize_examples(_examples(3, seed=6), template, 80, "skip")
    loader = SFTLoader(toks, 80, 3, seed=0, packing="pad", pad_id=7)
    batch = loader.next_batch()
    model = _tiny_model(template.tokenizer.vocab_size, 80)
    with torch.no_grad():
        loss, n = NextTokenLoss(model)(batch.inputs, batch.targets, batch.doc_ids)
        logp = torch.log_softmax(model.logits(model(batch.inputs, batch.doc_ids)).double(), dim=-1)
    want, count = 0.0, 0
    for r, row in enumerate(loader.epoch_rows(0)[:3]):
        ex = toks[row[0]]
        assert torch.equal(batch.inputs[r, : len(ex.ids) - 1], torch.from_numpy(ex.ids[:-1]))
        for t in range(len(ex.ids) - 1):
            if ex.mask[t + 1]:
                want -= float(logp[r, t, int(ex.ids[t + 1])])
                count += 1
    assert int(n) == count == sum(int(toks[row[0]].mask[1:].sum()) for row in loader.epoch_rows(0)[:3])
    assert loss.dtype == torch.float32
    # an FP32 sum of the response tokens' losses against a float64 sum of the same FP32 values: rounding of
    # a sum of a few dozen terms (n u with u = 2^-24 = 6e-8: ~2e-6 worst case, ~5e-7 for a random walk)
    assert abs(float(loss) - want) <= 1e-6 * abs(want)


def test_packed_rows_hold_distinct_documents_and_equal_their_examples_alone(template):
    toks, _ = tokenize_examples(_examples(12, seed=7), template, 128, "skip")
    loader = SFTLoader(toks, 128, 2, seed=1, packing="pack")
    rows = loader.epoch_rows(0)
    assert sorted(i for row in rows for i in row) == list(range(12))
    assert any(len(row) > 1 for row in rows)
    batch = loader.next_batch()
    model = _tiny_model(template.tokenizer.vocab_size, 128)
    for r, row in enumerate(rows[:2]):
        inputs, targets, docs = batch.inputs[r], batch.targets[r], batch.doc_ids[r]
        at, alone = 0, torch.zeros((), dtype=torch.float64)
        for d, i in enumerate(row):
            n = len(toks[i].ids) - 1
            assert (docs[at : at + n] == d).all()
            assert targets[at] == -100 and targets[at + n - 1] == -100  # an example's first and last
            x = torch.from_numpy(toks[i].ids[:-1])[None]
            y = torch.from_numpy(np.where(toks[i].mask[1:], toks[i].ids[1:], -100))[None]
            assert torch.equal(inputs[at : at + n], x[0]) and torch.equal(targets[at : at + n], y[0])
            with torch.no_grad():
                alone += NextTokenLoss(model)(x, y)[0].double()
            at += n
        assert (docs[at:] == len(row)).all() and (targets[at:] == -100).all()
        with torch.no_grad():
            packed, _ = NextTokenLoss(model)(inputs[None], targets[None], docs[None])
        # packed (one row, document-masked) against each example alone: FP32 sums of <= 128 losses and
        # softmaxes over <= 128 keys in other orders (128 u = 7.6e-6 worst case)
        assert abs(float(packed) - float(alone)) <= 1e-5 * float(alone)


def test_loader_resumes_exactly(template):
    toks, _ = tokenize_examples(_examples(10, seed=8), template, 80, "skip")
    for packing in ("pack", "pad"):
        whole = SFTLoader(toks, 80, 3, seed=2, packing=packing)
        want = [whole.next_batch() for _ in range(12)]  # several epochs
        first = SFTLoader(toks, 80, 3, seed=2, packing=packing)
        for _ in range(5):
            first.next_batch()
        state = first.state_dict()
        later = SFTLoader(toks, 80, 3, seed=99, packing=packing)
        later.load_state_dict(state)
        assert later.epoch == first.epoch > 1.0
        assert later.summary() == first.summary()
        assert later.summary()["sft"]["sequences"] == 15 and later.summary()["sft"]["examples"] == 10
        for w in want[5:]:
            got = later.next_batch()
            assert all(torch.equal(a, b) for a, b in zip(vars(got).values(), vars(w).values(), strict=True))
    other = SFTLoader(toks, 80, 3, seed=2, packing="pad")
    with pytest.raises(DataError, match=r"posttrain\.packing"):
        other.load_state_dict(SFTLoader(toks, 80, 3, seed=2, packing="pack").state_dict())
    with pytest.raises(DataError, match=r"posttrain\.train_files"):
        other.load_state_dict(SFTLoader(toks[:-1], 80, 3, seed=2, packing="pad").state_dict())


def test_ranks_read_disjoint_rows_that_cover_the_data(template):
    toks, _ = tokenize_examples(_examples(16, seed=9), template, 80, "skip")
    ranks = [SFTLoader(toks, 80, 2, seed=3, packing="pad", rank=r, world=2) for r in range(2)]
    single = SFTLoader(toks, 80, 4, seed=3, packing="pad")
    seen: list[list[tuple]] = [[], []]
    for _ in range(4):  # one epoch: 16 examples = 4 steps x 2 ranks x 2 rows
        both = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([b.inputs for b in both]), single.next_batch().inputs)
        for r, b in enumerate(both):
            seen[r] += [tuple(row.tolist()) for row in b.inputs]
    assert not set(seen[0]) & set(seen[1])
    everything = {tuple(np.pad(t.ids[:-1], (0, 80 - len(t.ids) + 1)).tolist()) for t in toks}
    assert set(seen[0]) | set(seen[1]) == everything
    assert ranks[0].position == ranks[1].position == 16 and ranks[0].epoch == 1.0


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_eval_batches_hold_every_example_once_in_order(template, packing):
    toks, _ = tokenize_examples(_examples(11, seed=10), template, 96, "skip")
    segments: list[list[int]] = []
    rows = 0
    for batch in sft_eval_batches(toks, 96, 3, packing, pad_id=-1):
        rows += len(batch.inputs)
        for inputs, docs in zip(batch.inputs, batch.doc_ids, strict=True):
            for d in range(int(docs.max()) + 1):
                seg = inputs[docs == d].tolist()
                if set(seg) != {-1}:  # not the padding
                    segments.append(seg)
    assert segments == [t.ids[:-1].tolist() for t in toks]
    assert (rows < len(toks)) if packing == "pack" else (rows == len(toks))
    assert isinstance(toks[0], Tokenized)
