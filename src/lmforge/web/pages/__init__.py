"""One module per page; each defines ``PAGE`` (``lmforge.web.registry.Page``) or ``PAGE = None``."""
