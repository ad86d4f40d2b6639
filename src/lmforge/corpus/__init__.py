"""``lmforge data``: readers, stages, executors and the pipeline that turns raw files into documents.

Nothing here imports :mod:`lmforge.data` (what training reads) or :mod:`lmforge.train`; those import
this package.
"""
