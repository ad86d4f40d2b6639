"""Reading finished and running run folders for people: ``lmforge plot`` (``plots.py``) and
``lmforge compare`` (``compare.py``), both over the records that ``runs.py`` reads; and the PNG charts of
the probes and the planner (``charts.py``: ``plot-schedule``, ``lr-find``, ``mup-check``, ``tokenizers
compare``, ``estimate --plot``)."""
