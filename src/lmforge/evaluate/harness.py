"""An lm-evaluation-harness backend: a run's newest checkpoint as the harness's model ``lmforge``.

Importing this module registers ``lmforge`` in the harness's model registry, so
``lm_eval.simple_evaluate(model="lmforge", model_args="run=RUN")`` works in any program that imported it.
The harness's own command (``lm_eval``, 0.4.x) finds only the models of its own package: it reads no
entry point and imports no plugin. ``python -m lmforge.evaluate.harness ARGS`` is that command with
``lmforge`` registered (the same flags: ``--model lmforge --model_args run=RUN --tasks ...``).

The three request types, tokenized as the exported model's tokenizer does (``<|endoftext|>`` before a
text, the document start every training document had; ``docs/evaluation.md``):

* ``loglikelihood``: ``log p(continuation | context)`` summed over the continuation's tokens, and whether
  each of them is the argmax; the harness's split of context and continuation (``TemplateLM``), the
  window cut from the left to ``max_seq_len`` tokens as its ``hf`` backend cuts it.
* ``loglikelihood_rolling``: a text's log-likelihood after ``<|endoftext|>``, in disjoint windows of
  ``max_seq_len`` predicted tokens: minus the run's own next-token loss summed over the text.
* ``generate_until``: greedy (or sampled, with ``do_sample``) continuations through the key/value cache
  (``model/sampling.py::generate_batch``), ending at ``<|endoftext|>``; the text is cut at the first of
  the task's ``until`` strings.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

# the harness's own models first: its registry adds them only while it is empty
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lmforge.errors import UserError
from lmforge.evaluate.run_loading import load_run
from lmforge.model.sampling import generate_batch
from lmforge.precision import PrecisionPolicy
from lmforge.tokenizer import EOT

log = logging.getLogger(__name__)

# ((context, continuation) or None, context ids, continuation ids): what TemplateLM hands the scorer
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


def harness_device(name: str | None) -> torch.device:
    """The ``device`` model argument: None or ``auto``: CUDA when present; a CUDA device without a GPU
    falls back to the CPU as the harness's ``hf`` backend does (the ``lm_eval`` command passes
    ``cuda:0`` unless told ``--device``)."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %s: no CUDA GPU is visible; scoring on the CPU", name)
        return torch.device("cpu")
    return torch.device(name)


def batch_size_of(value: int | str) -> int:
    """The ``batch_size`` argument as a positive integer; ``auto`` is refused."""
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UserError(
            f"batch_size: {value!r} is not supported by the lmforge backend; give an integer >= 1"
        ) from None
    if size < 1:
        raise UserError(f"batch_size: {size} is out of range; give an integer >= 1")
    return size


class LmforgeLM(TemplateLM):
    """The newest (or ``step``'s) checkpoint of the run folder ``run`` as a harness model.

    Model arguments: ``run`` (the run folder), ``device`` (``cpu``, ``cuda``, ``auto``), ``batch_size``
    (rows per forward pass), ``step`` (a checkpoint other than the newest), ``max_gen_toks`` (generated
    tokens when a task names none), ``seed`` (the draws of ``do_sample`` tasks)."""

    def __init__(
        self,
        run: str,
        device: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,  # the harness's "auto" batching: not used
        step: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
    ):
        super().__init__()
        self.batch = batch_size_of(batch_size)
        self._device = harness_device(device)
        self.cfg, self.tok, model, self.step = load_run(Path(run), self._device, step)
        self.model = model.eval()
        self.precision = PrecisionPolicy.resolve(self.cfg.train.precision, self._device)
        self.max_length = model.max_seq_len
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return str(self.tok.path)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """``<|endoftext|>`` + the text's ids, as the exported tokenizer encodes (not when
        ``add_special_tokens`` is False, nor before a text that starts with ``<|endoftext|>``)."""
        ids = self.tok.encode(string)
        if add_special_tokens is False or (add_special_tokens is None and string.startswith(EOT)):
            return ids
        return [self.tok.eot_id, *ids]

    @torch.inference_mode()
    def _score(self, rows: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """``(sum of log p, all greedy)`` of each row's last ``len(cont)`` predictions against ``cont``;
        the rows right-padded into one forward pass (causal: padding changes no earlier position)."""
        longest = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows], device=self._device)
        with self.precision.autocast():
            hidden = self.model(ids)
        out = []
        for b, (row, cont) in enumerate(zip(rows, conts, strict=True)):
            with self.precision.autocast():
                logits = self.model.logits(hidden[b, len(row) - len(cont) : len(row)])
            logp = torch.log_softmax(logits.float(), dim=-1)
            target = torch.tensor(cont, device=self._device)
            total = logp.gather(-1, target[:, None]).sum().item()
            out.append((float(total), bool((logp.argmax(-1) == target).all())))
        return out

    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """Each request's ``(log p(continuation | context), greedy)``; a context and continuation longer
        than the model's ``max_seq_len`` + 1 lose tokens from the left, as the ``hf`` backend's do."""
        n = self.max_length
        rows, conts = [], []
        for _, ctx, cont in requests:
            if not cont or len(cont) > n:
                raise UserError(
                    f"a continuation of {len(cont)} tokens cannot be scored by a model of max_seq_len {n}"
                )
            if len(ctx) + len(cont) > n + 1:
                log.warning("context + continuation of %d tokens: cut to %d", len(ctx) + len(cont), n + 1)
            rows.append((ctx + cont)[-(n + 1) :][:-1])
            conts.append(cont)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            for i, res in zip(
                chunk, self._score([rows[i] for i in chunk], [conts[i] for i in chunk]), strict=True
            ):
                results[i] = res
        for (pair, _, _), res in zip(requests, results, strict=True):
            if pair is not None:
                self.cache_hook.add_partial("loglikelihood", pair, res)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood after ``<|endoftext|>``: the harness's disjoint windows of
        ``max_seq_len`` predicted tokens (each window's first prediction sees the token before it)."""
        out = []
        for (text,) in (r.args for r in requests):
            windows = get_rolling_token_windows(self.tok.encode(text), self.tok.eot_id, self.max_length, 1)
            pieces: list[TokenRequest] = [(None, *make_disjoint_window(w)) for w in windows]
            total = sum(score for score, _ in self._loglikelihood_tokens(pieces)) if pieces else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, cut at the first of its ``until`` strings; requests with the same
        generation arguments run in batches of ``batch_size``, longest prompt first."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        out = [""] * len(requests)
        for members in groups.values():
            contexts = [requests[i].args[0] for i in members]
            for i, text in zip(members, self._generate(contexts, requests[members[0]].args[1]), strict=True):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: Sequence[str], gen_kwargs: dict) -> list[str]:
        """The continuations of ``contexts`` under one task's generation arguments."""
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=EOT)
        new = kwargs.pop("max_gen_toks")
        room = self.max_length - new
        if room <= 0:
            raise UserError(
                f"max_gen_toks: {new} leaves no room for a prompt in max_seq_len {self.max_length}; "
                "give fewer in the task's generation_kwargs"
            )
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        prompts = [self.tok_encode(c)[-room:] for c in contexts]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts = [""] * len(prompts)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            with self.precision.autocast():
                ids = generate_batch(
                    self.model,
                    [prompts[i] for i in chunk],
                    new,
                    temperature=temperature,
                    top_k=int(kwargs.get("top_k", 0) or 0),
                    top_p=float(kwargs.get("top_p", 1.0) or 1.0),
                    stop_tokens=(self.tok.eot_id,),
                    seed=self.seed,
                )
            for i, row in zip(chunk, ids, strict=True):
                texts[i] = postprocess_generated_text(self.tok.decode(row), until, None)
        return texts


if "lmforge" not in model_registry:  # once, also when this file runs as ``python -m``
    register_model("lmforge")(LmforgeLM)


def main(argv: list[str] | None = None) -> int:
    """``lm_eval``'s command line with ``lmforge`` registered; a user error: one line, exit status 2."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except UserError as exc:
        print(f"lm_eval --model lmforge: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
