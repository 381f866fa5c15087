"""World carries the local rank and local world size (issue 31): one reader of LOCAL_RANK /
LOCAL_WORLD_SIZE (runtime/world.py), used by the thread, device and doctor policies."""
from __future__ import annotations

import pytest

from fastload.runtime.system import local_world_size
from fastload.runtime.world import World, local_env


@pytest.fixture
def env(monkeypatch):
    for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_detect_reads_local_rank_and_local_world_size(env):
    env.setenv("LOCAL_RANK", "3")
    env.setenv("LOCAL_WORLD_SIZE", " 8 ")
    w = World.detect()
    assert (w.local_rank, w.local_world_size) == (3, 8)
    assert (w.rank, w.world_size, w.source) == (0, 1, "default")
    w = World.detect(1, 4)  # rank and world size as arguments: the node's numbers still come from the launcher
    assert (w.rank, w.world_size, w.source, w.local_rank, w.local_world_size) == (1, 4, "arguments", 3, 8)
    assert local_world_size() == 8


def test_local_fields_unset_or_malformed_are_none(env):
    assert (World.detect().local_rank, World.detect().local_world_size) == (None, None)
    assert local_world_size() == 1
    for lr, lws in (("x", "0"), ("-1", "two"), ("", "")):
        env.setenv("LOCAL_RANK", lr)
        env.setenv("LOCAL_WORLD_SIZE", lws)
        assert local_env() == (None, None)
        w = World.detect()
        assert (w.local_rank, w.local_world_size) == (None, None)
        assert local_world_size() == 1


def test_local_arguments_win_and_are_checked(env):
    env.setenv("LOCAL_RANK", "3")
    env.setenv("LOCAL_WORLD_SIZE", "8")
    w = World.detect(local_rank=1, local_world_size=2)
    assert (w.local_rank, w.local_world_size) == (1, 2)
    with pytest.raises(ValueError, match=r"local_world_size=0 must be an int"):
        World.detect(local_world_size=0)
    with pytest.raises(ValueError, match=r"local_rank=-1 must be an int"):
        World(local_rank=-1)
    with pytest.raises(ValueError, match=r"local_rank=True must be an int"):
        World.detect(local_rank=True)
