"""``lmforge data``: readers, stages, executors and the pipeline that turns raw files into documents, the
model-based stages' models and the cleaning sweep (``sweep.py``).

Nothing here imports :mod:`lmforge.data` (what training reads) or :mod:`lmforge.train` at module level;
those import this package. Two functions reach up when they run: a ``perplexity`` stage loads its run
through ``lmforge eval``'s loader (``lm_scorer.py``) and the sweep counts tokens with training's tokenizer
(``sweep.py``).
"""
