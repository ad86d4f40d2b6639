"""Hugging Face ``transformers`` export and import (``lmforge export``, ``lmforge import``).

``llama.py`` and ``gpt2.py`` are the pure config and tensor-name maps of one architecture each
(``mixtral.py``, ``qwen2_moe.py``, ``glm4_moe.py`` those of mixtures of experts; ``moe.py`` picks one),
``files.py`` reads and writes the folder's files (safetensors, sharded or not; tokenizer files),
``export.py`` turns a run's checkpoint into a folder ``from_pretrained`` loads, ``import_.py`` turns such
a folder into a run folder. Nothing here imports ``transformers``: the files are written by hand and
the tests load them with ``transformers``. Name maps, refusals and measured agreement: ``docs/hf.md``.
"""
