"""tierstore: multi-tier storage and serving for Engram n-gram embedding tables."""
__version__ = "0.1.0"
