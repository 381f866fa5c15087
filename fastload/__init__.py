"""fastload: a data loader for PyTorch training that runs at the speed of the hardware."""
from .convert import ConvertError, convert
from . import vision
from .errors import DecodeError, FastloadError
from .loader import Loader
from .sampling import Sampler
from .store import FORMAT_VERSION, Dataset, Field, FormatError, ShardWriter, verify

__version__ = "0.1.0"

__all__ = sorted([
    "ConvertError", "Dataset", "DecodeError", "FastloadError", "Loader", "vision", "FORMAT_VERSION", "Field", "FormatError", "ShardWriter", "Sampler", "__version__",
    "convert", "verify",
])
