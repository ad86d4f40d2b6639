"""Pipeline stages of ``lmforge data``: one module per stage, each built on :mod:`.base`."""
