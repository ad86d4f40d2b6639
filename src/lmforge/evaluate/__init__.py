"""Scoring trained runs: run loading (``run_loading.py``: ``lmforge eval``, ``generate``), the validation
loops (``validation.py``, which training's ``Evaluation`` callback runs too) and ``lmforge eval --data``
(``files.py``: the user's files scored in validation windows)."""
