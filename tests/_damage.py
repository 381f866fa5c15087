"""A damaged copy of a dataset, for the tests of what verification reports."""
from __future__ import annotations

import shutil
from pathlib import Path


def damaged_copy(src: Path, dst: Path) -> Path:
    """Copy the dataset ``src`` to ``dst`` and flip one byte in the middle of its first shard;
    returns that shard's path."""
    shutil.copytree(src, dst)
    shard = sorted(Path(dst).glob("shard-*.arrow"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard
