"""How a plain model becomes the model a run trains: transformations applied from outside, in one fixed
order (``apply.py``); device meshes and layouts come here with ``parallel.*``."""
