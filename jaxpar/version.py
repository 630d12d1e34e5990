"""jaxpar's version: a leaf, so that a module of any layer can record it (checkpoints do)."""

__version__ = "0.1.0"
