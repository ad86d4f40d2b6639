"""lmforge: train language models from raw text to an exported model."""

__version__ = "0.1.0"
