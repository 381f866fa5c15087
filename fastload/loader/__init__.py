"""The Loader and its parts (see loader.py for the map). Users import ``fastload.Loader``."""
from .loader import LOADER_STATE_VERSION, Loader, dataset_fingerprint

__all__ = ["LOADER_STATE_VERSION", "Loader", "dataset_fingerprint"]
