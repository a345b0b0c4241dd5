"""tierstore: multi-tier storage and serving for Engram n-gram embedding tables."""
__all__ = ["__version__"]

__version__ = "0.1.0"
