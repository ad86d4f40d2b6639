"""Three tokenizer kinds trained with Hugging Face ``tokenizers``, each a ``tokenizer.json`` lmforge trains with.

* ``bpe``: lmforge's own byte-level BPE (:func:`lmforge.tokenizer.train_tokenizer`): 256 byte symbols,
  so every string has a tokenization and there is no unknown token by construction.
* ``unigram``: SentencePiece's unigram language model on the same pre-tokens as byte-level BPE (GPT-2's
  split: a word with its leading space, runs of digits, of punctuation, of whitespace), spaces written as
  ``▁`` (Metaspace, nothing prepended), no normalizer; with SentencePiece byte fallback: the 256 pieces
  ``<0x00>`` ..
  ``<0xFF>`` are added after training and a character outside the learned pieces is written as its UTF-8
  bytes instead of ``<unk>`` (``tokenizers`` supports ``byte_fallback`` on its ``Unigram`` model). The
  trainer insists on a piece for every character it sees, so characters outside the most frequent
  ``(vocab - 258) // 2`` are blanked out of the training text (:func:`frequent_chars_only`).
* ``wordpiece``: BERT's WordPiece (BERT normalizer without lowercasing or accent stripping, BERT
  pre-tokenizer: split on whitespace and punctuation, ``##`` continuation prefix). A character outside its
  alphabet, or a word longer than 100 characters, becomes ``[UNK]``; whitespace is not kept, so decoding
  does not give the text back.

Every kind carries the special token ``<|endoftext|>`` (lmforge's document separator), so
``data.tokenizer = PATH`` works with any of them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from lmforge.tokenizer import EOT, Tokenizer, train_tokenizer

KINDS = ("bpe", "unigram", "wordpiece")
UNIGRAM_UNK = "<unk>"
WORDPIECE_UNK = "[UNK]"
# GPT-2's pre-tokenization (what byte-level BPE's ByteLevel pre-tokenizer splits by): a word with its
# leading space, digit runs, punctuation runs, whitespace runs (so an indentation is one unit)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))
# smallest vocabulary each kind is trained at: BPE 256 bytes + EOT + 1 merge; unigram EOT + <unk> + 256
# byte pieces + 126 learned pieces; WordPiece: room for a character alphabet of about a hundred symbols
MIN_VOCAB = {"bpe": 258, "unigram": 384, "wordpiece": 128}


def unknown_tokens(kind: str) -> tuple[str, ...]:
    """The tokens that stand for text the vocabulary does not cover: [UNK] / <unk> / the byte pieces."""
    if kind == "unigram":
        return (UNIGRAM_UNK, *BYTE_PIECES)
    if kind == "wordpiece":
        return (WORDPIECE_UNK,)
    return ()  # byte-level BPE: every byte is a symbol, nothing is unknown


def train_kind(kind: str, texts: Iterable[str], vocab_size: int, path: str | Path) -> Tokenizer:
    """Train a tokenizer of ``kind`` with ``vocab_size`` entries (specials included) and save it to ``path``."""
    if kind == "bpe":
        return train_tokenizer(texts, vocab_size, path)
    if kind == "unigram":
        tok = _train_unigram(texts, vocab_size)
    elif kind == "wordpiece":
        tok = _train_wordpiece(texts, vocab_size)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(KINDS)}")
    return _save(tok, Path(path))


def frequent_chars_only(texts: list[str], keep: int) -> list[str]:
    """``texts`` with every character outside the ``keep`` most frequent ones replaced by a space.

    The unigram trainer must hold every character it sees in the vocabulary (it fails otherwise); with byte
    fallback the rare ones need no piece of their own, so they are left out of training this way."""
    counts: Counter[str] = Counter()
    for t in texts:
        counts.update(t)
    if len(counts) <= keep:
        return texts
    allowed = {c for c, _ in counts.most_common(keep)}
    table = {ord(c): " " for c in counts if c not in allowed}
    return [t.translate(table) for t in texts]


def _train_unigram(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    learned = vocab_size - len(BYTE_PIECES)  # the pieces the trainer picks, its two specials included
    texts = frequent_chars_only(list(texts), (learned - 2) // 2)  # at least half for longer pieces
    tok = HFTokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False),
        ]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=learned,
        special_tokens=[EOT, UNIGRAM_UNK],
        unk_token=UNIGRAM_UNK,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # add the byte pieces (scored below every learned piece, so they are used only as the fallback)
    spec = json.loads(tok.to_str())
    model = spec["model"]
    known = {piece for piece, _ in model["vocab"]}
    floor = min(score for _, score in model["vocab"]) - 10.0
    model["vocab"] += [[piece, floor] for piece in BYTE_PIECES if piece not in known]
    model["byte_fallback"] = True
    tok = HFTokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="never", split=False)]
    )
    return tok


def _train_wordpiece(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer(models.WordPiece(unk_token=WORDPIECE_UNK))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT, WORDPIECE_UNK],
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _save(tok: HFTokenizer, path: Path) -> Tokenizer:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return Tokenizer(path)
