"""The token shards of a ``lmforge data`` output: a tokenizer and shards per domain in ``OUT/tokens``;
and ``lmforge data`` itself (:func:`clean_and_tokenize`: the corpus pipeline, then these shards).

The corpus pipeline (:mod:`lmforge.corpus.pipeline`) leaves kept documents in ``OUT/kept``; this turns
them into what training reads (``data.prepared = OUT``), with the same writer as training's own cache
(:func:`lmforge.data.prepare.write_token_shards`). The shards are reused while the kept files, the
``[tokenize]`` settings and a given tokenizer are unchanged; otherwise they are built in
``OUT/tokens.building`` and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from lmforge.corpus.config import PipelineConfig
from lmforge.corpus.pipeline import Layout, iter_kept, kept_fingerprint, run_pipeline, write_report
from lmforge.data.prepare import write_token_shards
from lmforge.data.shards import read_meta
from lmforge.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def tokenize_output(cfg: PipelineConfig, out: str | Path) -> dict[str, Any]:
    """Tokenizer + token shards per domain of the kept documents in ``OUT/tokens`` (reused if current).

    Returns the summary the run's report carries under ``tokens``: vocabulary size, documents and tokens
    per (domain, split).
    """
    lay = Layout(out, cfg.output.compression)
    tcfg = cfg.tokenize
    user_tok = Tokenizer(tcfg.tokenizer) if tcfg.tokenizer else None
    h = hashlib.sha256(kept_fingerprint(out).encode())
    h.update(json.dumps(tcfg.model_dump(mode="json"), sort_keys=True).encode())
    h.update((user_tok.sha256 if user_tok else "").encode())
    fingerprint = h.hexdigest()
    meta = read_meta(lay.tokens)
    if meta is None or meta.get("input_fingerprint") != fingerprint:
        build = lay.out / "tokens.building"
        shutil.rmtree(build, ignore_errors=True)
        build.mkdir(parents=True)
        meta = write_token_shards(
            build,
            lambda: iter_kept(out),
            tcfg.vocab_size,
            tcfg.val_fraction,
            user_tok,
            fingerprint,
            f"{lay.kept}: no documents were kept; loosen the stages or check the sources",
        )
        shutil.rmtree(lay.tokens, ignore_errors=True)
        build.rename(lay.tokens)
    else:
        log.info("data: token shards in %s are current", lay.tokens)
    return {"vocab_size": meta["vocab_size"], "documents": meta["documents"], "tokens": meta["tokens"]}


def clean_and_tokenize(
    cfg: PipelineConfig,
    out: str | Path,
    executor: str | None = None,
    workers: int | None = None,
    tokenize: bool = True,
) -> dict[str, Any]:
    """``lmforge data``: the pipeline of ``cfg`` into ``out`` (:func:`lmforge.corpus.pipeline.run_pipeline`),
    then, when ``[tokenize]`` is enabled and ``tokenize``, the token shards (:func:`tokenize_output`),
    whose figures join the report (``report["tokens"]``, ``OUT/report.json``). Returns the report."""
    report = run_pipeline(cfg, out, executor=executor, workers=workers)
    if cfg.tokenize.enabled and tokenize:
        report["tokens"] = tokenize_output(cfg, out)
        write_report(Layout(out).report, report)
    return report
