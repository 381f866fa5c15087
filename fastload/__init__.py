"""fastload: a data loader for PyTorch training that runs at the speed of the hardware.

This module is the public face only. Every name below is resolved on first use (PEP 562
module ``__getattr__``), so ``import fastload`` loads neither torch nor DALI: ``fastload
--help``, ``convert``, ``inspect`` and ``verify`` (and conversion workers) stay light, and
torch is imported when a ``Loader`` or a ``Dataset`` is first asked for.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "BadSamples",
    "ConvertError",
    "Dataset",
    "DecodeError",
    "FORMAT_VERSION",
    "FastloadError",
    "Field",
    "FormatError",
    "Loader",
    "MissingFileError",
    "Mixture",
    "NoSpaceError",
    "Ragged",
    "SampleError",
    "Sampler",
    "ShardWriter",
    "TransformError",
    "UsageError",
    "__version__",
    "audio",
    "convert",
    "verify",
    "video",
    "vision",
]
assert sorted(__all__) == __all__

# public name -> the module it is taken from. Absolute names, so that tests can follow them.
_HOMES = {
    "BadSamples": "fastload.errors",
    "ConvertError": "fastload.errors",
    "Dataset": "fastload.store",
    "DecodeError": "fastload.errors",
    "FORMAT_VERSION": "fastload.store",
    "FastloadError": "fastload.errors",
    "Field": "fastload.store",
    "FormatError": "fastload.errors",
    "Loader": "fastload.loader",
    "MissingFileError": "fastload.errors",
    "Mixture": "fastload.store.mixture",
    "NoSpaceError": "fastload.errors",
    "Ragged": "fastload.store",
    "SampleError": "fastload.errors",
    "Sampler": "fastload.sampling",
    "ShardWriter": "fastload.store",
    "TransformError": "fastload.errors",
    "UsageError": "fastload.errors",
    "audio": "fastload.audio",
    "convert": "fastload.convert",
    "verify": "fastload.store",
    "video": "fastload.video",
    "vision": "fastload.vision",
}
assert sorted(_HOMES) == [n for n in __all__ if n != "__version__"]
# public names that are modules themselves; the package fastload.convert is callable as its
# convert() function, and it is what ``import fastload.convert`` binds here in any case
_MODULES = {"audio", "convert", "video", "vision"}


def _resolve(name: str) -> Any:
    module = importlib.import_module(_HOMES[name])
    if name in _MODULES:
        return module
    return getattr(module, name)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}; "
                             f"the public names are {', '.join(__all__)}")
    value = _resolve(name)
    globals()[name] = value  # resolved once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs only; never executed
    from . import audio, convert, video, vision
    from .errors import (BadSamples, ConvertError, DecodeError, FastloadError, FormatError, MissingFileError,
                         NoSpaceError, SampleError, UsageError)
    from .loader import Loader
    from .sampling import Sampler
    from .store import FORMAT_VERSION, Dataset, Field, ShardWriter, verify
