"""The on-disk format: Arrow IPC shards plus manifest.json (see docs/FORMAT.md)."""
from .format import FORMAT_VERSION, Field, FormatError, parse_field
from .reader import Dataset, read_manifest
from .verify import verify
from .writer import SampleError, ShardWriter, parse_size

__all__ = ["FORMAT_VERSION", "Dataset", "Field", "FormatError", "SampleError", "ShardWriter", "parse_field",
           "parse_size", "read_manifest", "verify"]
