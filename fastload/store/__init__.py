"""The on-disk format: Arrow IPC shards plus manifest.json (see docs/FORMAT.md).

Importing this package loads neither torch nor DALI: reading is :class:`DatasetReader`.
``Dataset`` (the same reader as a ``torch.utils.data.Dataset``) imports torch when it is
first accessed (``from fastload.store import Dataset``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import FormatError, SampleError
from .format import FORMAT_VERSION, Field, parse_field, parse_size
from .reader import DatasetReader, read_manifest
from .values import Ragged
from .full_check import verify
from .writer import ShardWriter

if TYPE_CHECKING:
    from .dataset import Dataset

__all__ = ["FORMAT_VERSION", "Dataset", "DatasetReader", "Field", "FormatError", "Ragged", "SampleError", "ShardWriter",
           "parse_field", "parse_size", "read_manifest", "verify"]


def __getattr__(name: str):
    if name == "Dataset":  # PEP 562: torch is imported here, on first use, not with the package
        from .dataset import Dataset

        globals()["Dataset"] = Dataset
        return Dataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"Dataset"})
