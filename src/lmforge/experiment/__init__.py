"""``lmforge experiment``: arms of a recipe (each combination of the ``--vary`` values) trained over several
seeds, interleaved, each an ordinary run folder under one experiment folder; then per metric each arm's
mean, spread and a Welch t-test against the first arm, a table and a plot.

``stats.py`` (pure: mean, sample standard deviation, Welch's t-test with the t distribution's CDF),
``plan.py`` (the arms and seeds from the flags, checked before any run; the interleaved order),
``run.py`` (the runs, resumable), ``results.py`` (metrics read back from the run folders, the tables).
"""
