"""One byte formatter (issue 31): fastload.errors.format_bytes, used by every message that
names a size (inspect, the CLI, memory checks, doctor, the remote cache, NoSpaceError)."""
from __future__ import annotations

import re

import pytest

from fastload.errors import NoSpaceError, format_bytes, parse_bytes


@pytest.mark.parametrize("n, decimal, binary", [
    (0, "0 B", "0 B"), (812, "812 B", "812 B"), (1000, "1.0 KB", "1000 B"), (1536, "1.5 KB", "1.5 KiB"),
    (64 << 10, "65.5 KB", "64 KiB"), (1_234_567, "1.2 MB", "1.2 MiB"), (600 << 20, "629.1 MB", "600 MiB"),
    (1 << 30, "1.1 GB", "1 GiB"), (3 * 10**9, "3.0 GB", "2.8 GiB"), (25 * 10**12, "25.0 TB", "22.7 TiB"),
    (5 * 10**15, "5000.0 TB", "4547.5 TiB"),
])
def test_decimal_and_binary_units(n, decimal, binary):
    assert format_bytes(n) == decimal
    assert format_bytes(n, binary=True) == binary


def test_what_it_prints_parses_back():
    """Decimal output is in the units parse_bytes (--shard-size, cache_limit) takes."""
    for n in (1500, 1_500_000, 2_500_000_000):
        assert parse_bytes(format_bytes(n).replace(" ", "")) == n


def test_the_memory_check_names_sizes_in_the_one_format(monkeypatch):
    import fastload.runtime.system as system

    monkeypatch.setattr(system, "available_memory", lambda: 500 * 10**6)
    with pytest.raises(ValueError, match=re.escape("the ring needs 2.0 TB of memory, but only 500.0 MB is "
                                                   "available; lower prefetch")):
        system.check_fits_in_memory(2 * 10**12, "the ring", "lower prefetch")


def test_inspect_and_doctor_use_it(tmp_path):
    import numpy as np

    import fastload
    from fastload.doctor.facts import _bytes
    from fastload.store.inspect import inspect_text

    assert (_bytes(-1), _bytes(64 << 10), _bytes(1 << 30)) == ("unlimited", "64 KiB", "1 GiB")
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[16]"}) as w:
        for i in range(40):
            w.write({"x": np.full(16, i, np.float32)})
    total = sum(s["bytes"] for s in fastload.store.read_manifest(tmp_path / "ds")["shards"])
    assert f"({format_bytes(total)};" in inspect_text(tmp_path / "ds")
    assert "KB" in format_bytes(total)


def test_no_space_error_names_sizes(tmp_path):
    e = NoSpaceError(tmp_path, needed=3 * 10**9, written=1500, detail="shard-00001.arrow")
    assert "after 1.5 KB" in str(e) and "needs about 3.0 GB" in str(e)
