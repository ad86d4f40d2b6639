"""Reading finished and running run folders for people: ``lmforge plot`` (``plots.py``) and
``lmforge compare`` (``compare.py``), both over the records that ``runs.py`` reads."""
