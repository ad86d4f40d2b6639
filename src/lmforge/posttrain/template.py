"""The chat template: conversations as token ids and the mask of the tokens the loss counts.

A conversation is rendered as ``<|endoftext|>`` (lmforge's document start) followed by, for each turn,
``<|role|>\\n`` + content + ``<|end|>\\n``. The role and end markers are special added tokens of the
run's tokenizer (:func:`add_chat_tokens`), so they are single ids. A marker's text inside a turn's content
is that marker's id too, as in Hugging Face's ``apply_chat_template`` (which renders one string and
tokenizes it with the added tokens matched everywhere): training, ``lmforge generate`` and the exported
model see the same ids for the same chat (docs/post-training.md says why this way). The loss mask is
True on the tokens of the assistant contents and their closing ``<|end|>`` (so the model learns to
stop); generation continues :meth:`ChatTemplate.prompt_ids` and stops at :attr:`ChatTemplate.end_id`.

``chat_template.json`` next to a run's ``tokenizer.json`` marks a chat run (``read_template``), and
:meth:`ChatTemplate.jinja` is the same template in Hugging Face's chat_template syntax.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from lmforge.errors import UserError
from lmforge.posttrain.records import ROLES, Turn
from lmforge.tokenizer import EOT, Tokenizer

SPECIAL_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
END = "<|end|>"
FORMAT = "lmforge-chat-1"
TEMPLATE_FILE = "chat_template.json"


def role_token(role: str) -> str:
    return f"<|{role}|>"


def add_chat_tokens(src: str | Path, dst: str | Path) -> Tokenizer:
    """Copy the tokenizer ``src`` to ``dst`` with :data:`SPECIAL_TOKENS` added as special tokens (new ids
    after the vocabulary; tokens already there keep theirs, so adding twice changes nothing)."""
    tok = HFTokenizer.from_file(str(src))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, dst)
    return Tokenizer(dst)


class ChatTemplate:
    """The chat template over one tokenizer that has the chat tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        hf = HFTokenizer.from_file(str(tokenizer.path))
        ids = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise UserError(
                f"{tokenizer.path}: the tokenizer lacks the chat tokens {' '.join(missing)}; "
                "fine-tune with lmforge sft, which adds them to the run's tokenizer"
            )
        self._text = hf  # contents: a marker's text is the marker, as apply_chat_template reads it
        self.token_ids: dict[str, int] = {t: int(i) for t, i in ids.items() if i is not None}
        self.role_ids = {r: self.token_ids[role_token(r)] for r in ROLES}
        self.end_id: int = self.token_ids[END]
        self.bos_id: int = tokenizer.eot_id
        self._newline = self._text.encode("\n", add_special_tokens=False).ids

    def _content(self, content: str) -> tuple[list[int], list[bool]]:
        """Ids of ``"\\n" + content`` (one text segment, as a tokenizer reading the rendered string sees
        it) and which of them carry content: every token ending after the newline."""
        enc = self._text.encode("\n" + content, add_special_tokens=False)
        return enc.ids, [end > 1 for _, end in enc.offsets]

    def render(self, turns: Sequence[Turn]) -> tuple[list[int], list[bool]]:
        """Ids of the whole conversation and the loss mask (True on assistant content and its ``<|end|>``)."""
        ids, mask = [self.bos_id], [False]
        for turn in turns:
            if turn.role not in self.role_ids:
                raise ValueError(f"unknown role {turn.role!r}")
            body, is_content = self._content(turn.content)
            learn = turn.role == "assistant"
            ids += [self.role_ids[turn.role], *body, self.end_id, *self._newline]
            mask += [False, *(learn and c for c in is_content), learn, *[False] * len(self._newline)]
        return ids, mask

    def prompt_ids(self, turns: Sequence[Turn]) -> list[int]:
        """``render(turns)`` followed by ``<|assistant|>\\n``: what generation continues."""
        return [*self.render(turns)[0], self.role_ids["assistant"], *self._newline]

    def decode_response(self, ids: Sequence[int]) -> str:
        """Text of generated ids up to (not including) the first ``<|end|>``."""
        ids = list(ids)
        if self.end_id in ids:
            ids = ids[: ids.index(self.end_id)]
        return self.tokenizer.decode(ids)

    @staticmethod
    def jinja() -> str:
        """The template in Hugging Face chat_template (Jinja) syntax, ``add_generation_prompt`` included."""
        return (
            "{{ '" + EOT + "' }}"
            "{% for message in messages %}"
            "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '" + END + "\\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
        )


def write_template_file(directory: str | Path) -> Path:
    """Write ``chat_template.json`` next to ``directory/tokenizer.json`` (which must have the chat tokens):
    the format name, the special tokens with their ids and the Jinja form."""
    directory = Path(directory)
    template = ChatTemplate(Tokenizer(directory / "tokenizer.json"))
    doc = {
        "format": FORMAT,
        "bos": EOT,
        "stop": END,
        "tokens": template.token_ids,
        "jinja": template.jinja(),
    }
    path = directory / TEMPLATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a run folder (or any folder holding ``tokenizer.json``); None when the folder
    has no ``chat_template.json`` (not a chat run)."""
    directory = Path(directory)
    path = directory / TEMPLATE_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not JSON ({exc.msg}); rewrite it or remove it for a plain run") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise UserError(f"{path}: format {found!r} is not {FORMAT!r}; it was not written by this lmforge")
    template = ChatTemplate(Tokenizer(directory / "tokenizer.json"))
    if doc.get("tokens") != template.token_ids:
        raise UserError(
            f"{path}: its token ids differ from {directory / 'tokenizer.json'}'s; the files do not match"
        )
    return template
