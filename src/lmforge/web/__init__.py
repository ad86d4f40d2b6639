"""``lmforge dashboard``: a local web app (Flask, Plotly's bundled JavaScript) with the training dashboard and
the interactive planners. Every figure a page shows comes from lmforge's own code (the planner, the
schedules, the optimizers, PyTorch's pipeline schedules, the run folders, ``lmforge data sweep``); the
browser only draws it. See ``docs/visual-tools.md``."""
