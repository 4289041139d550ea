"""The library version (a module of its own: `model.py` reads it without importing the package)."""
__version__ = "0.1.0"
