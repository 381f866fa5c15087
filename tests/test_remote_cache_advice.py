"""The window-mode CacheTooSmall advice is computed from what would fit: the smallest
cache_limit for the window in use, and the largest window that fits the cache_limit in use
(never the values already in use)."""
from __future__ import annotations

import re

import pytest

import fastload
from fastload.errors import CacheTooSmall

KW = dict(batch_size=50, seed=3, shuffle_mode="window", device="cpu", prefetch=2, threads=1)


def _refusal(url, cache_dir, limit, window, **kw):
    with pytest.raises(CacheTooSmall) as e:
        fastload.Loader(url, cache_dir=cache_dir, cache_limit=limit, window=window, **{**KW, **kw})
    return str(e.value), e.value.minimum


def _fits(url, cache_dir, limit, window, **kw) -> bool:
    try:
        fastload.Loader(url, cache_dir=cache_dir, cache_limit=limit, window=window, **{**KW, **kw}).close()
        return True
    except CacheTooSmall:
        return False


def test_window_advice_names_the_largest_window_that_fits(remote_url, tmp_path):
    c = tmp_path / "c"
    _, biggest = _refusal(remote_url, c, 1000, 8)  # below the largest shard: its size
    _, need8 = _refusal(remote_url, c, biggest, 8)  # the need of window=8
    limit = need8 - 1
    msg, minimum = _refusal(remote_url, c, limit, 8)
    assert minimum == need8 and f"at least {fastload.errors.format_bytes(need8)} ({need8} bytes)" in msg
    assert "window=8" not in msg and "prefetch=2" not in msg  # never the values in use
    m = re.search(r"read with window=(\d+), the largest window that fits cache_limit", msg)
    assert m, msg
    w = int(m.group(1))
    assert 1 <= w < 8
    assert _fits(remote_url, c, limit, w)  # it fits...
    assert not _fits(remote_url, c, limit, w + 1)  # ...and is the largest that does (w + 1 = 8 included)
    assert _fits(remote_url, c, need8, 8)  # the smallest cache_limit named for the window in use fits


def test_window_advice_when_no_window_fits(remote_url, tmp_path):
    c = tmp_path / "c"
    _, biggest = _refusal(remote_url, c, 1000, 1)
    _, need1 = _refusal(remote_url, c, biggest, 1, prefetch=4)
    msg, _ = _refusal(remote_url, c, need1 - 1, 1, prefetch=4)
    assert f"at least {fastload.errors.format_bytes(need1)} ({need1} bytes)" in msg
    assert "window=1 " not in msg.split("Raise cache_limit")[0]
    m = re.search(r"read with window=1 and prefetch=(\d+)", msg)
    if m:  # fewer batches in flight fit: the most that do
        p = int(m.group(1))
        assert 1 <= p < 4 and _fits(remote_url, c, need1 - 1, 1, prefetch=p)
        assert p == 3 or not _fits(remote_url, c, need1 - 1, 1, prefetch=p + 1)
    else:
        assert re.search(r"even window=1 with prefetch=1 needs .* \((\d+) bytes\)", msg), msg
