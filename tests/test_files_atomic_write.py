"""One atomic write (issue 31): fastload.files.atomic_write / atomic_file, one temporary-name
rule (``.NAME.PID.THREAD.tmp``), fsync of the file and its directory unless ``fsync=False``;
the writers of reports, plans, --json outputs and manifests all go through it."""
from __future__ import annotations

import json
import os
import re
import threading

import numpy as np
import pytest

import fastload.files as files
from fastload.files import atomic_file, atomic_write, temp_path


@pytest.fixture
def fsyncs(monkeypatch):
    """The descriptors fsynced through fastload.files: ("file", name) or ("dir", path)."""
    seen = []
    real = os.fsync

    def spy(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(("dir", target) if os.path.isdir(target) else ("file", os.path.basename(target)))
        return real(fd)

    monkeypatch.setattr(files.os, "fsync", spy)
    return seen


def test_bytes_text_and_a_writer_callback(tmp_path, fsyncs):
    p = tmp_path / "a.bin"
    atomic_write(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    atomic_write(p, "é\n")
    assert p.read_bytes() == "é\n".encode()
    atomic_write(p, lambda f: np.save(f, np.arange(3), allow_pickle=False))
    assert np.load(p).tolist() == [0, 1, 2]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.bin"]  # no temporary file left
    tmp = temp_path(p).name
    assert tmp == f".a.bin.{os.getpid()}.{threading.get_ident()}.tmp"
    # each write fsynced its (temporary) file, then the directory after the rename
    assert fsyncs == [("file", tmp), ("dir", str(tmp_path))] * 3


def test_fsync_false_writes_the_same_without_fsync(tmp_path, fsyncs):
    atomic_write(tmp_path / "c.json", '{"a": 1}', fsync=False)
    assert json.loads((tmp_path / "c.json").read_text()) == {"a": 1}
    assert fsyncs == []


@pytest.mark.parametrize("exc", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_keeps_the_old_content_and_removes_the_temporary_file(tmp_path, exc):
    p = tmp_path / "keep.txt"
    p.write_text("old")

    def half(f):
        f.write(b"half of the new")
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(p, half)
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["keep.txt"]
    with pytest.raises(type(exc)):
        with atomic_file(tmp_path / "new.txt") as f:
            f.write(b"x")
            raise exc
    assert sorted(x.name for x in tmp_path.iterdir()) == ["keep.txt"]  # never created


def test_threads_writing_one_file_never_share_a_temporary_file(tmp_path):
    p = tmp_path / "shared.txt"
    texts = [str(i) * 100_000 for i in range(8)]
    barrier = threading.Barrier(len(texts))

    def write(t):
        barrier.wait()
        for _ in range(5):
            atomic_write(p, t, fsync=False)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.read_text() in texts  # one writer's whole content, never a mix
    assert sorted(x.name for x in tmp_path.iterdir()) == ["shared.txt"]


def test_leftover_temporary_files_of_a_dataset_are_fastload_s_own():
    """--overwrite may delete a killed writer's temporary files (this rule's and the old one)."""
    from fastload.store.transaction import is_own_file

    for name in ("manifest.json", "skipped.jsonl", "shard-00003.arrow"):
        assert is_own_file(f".{name}.tmp") and is_own_file(temp_path(name).name), name
        assert is_own_file(f".{name}.123.4567.tmp")
    for foreign in (".manifest.json.x.tmp", ".manifest.json.1.tmp", ".thesis.tex.1.2.tmp", "manifest.json.1.2.tmp"):
        assert not is_own_file(foreign), foreign


def test_the_skipped_report_is_durable(tmp_path, fsyncs):
    from fastload.store.report import read_report, write_report

    assert write_report(tmp_path / "skipped.jsonl", [{"index": 1, "key": "k", "reason": "r"}]) == 1
    assert read_report(tmp_path) == [{"index": 1, "key": "k", "reason": "r"}]
    assert ("dir", str(tmp_path)) in fsyncs and [k for k, _ in fsyncs] == ["file", "dir"]


def test_the_cli_json_output_is_durable_and_a_failure_names_it(tmp_path, fsyncs):
    from fastload.cli import Output
    from fastload.errors import UsageError

    out = Output(str(tmp_path / "r.json"))
    out.json({"a": [1, 2]})
    assert json.loads((tmp_path / "r.json").read_text()) == {"a": [1, 2]}
    assert [k for k, _ in fsyncs] == ["file", "dir"]
    with pytest.raises(UsageError, match=re.escape(f"cannot write --json {tmp_path / 'no' / 'r.json'}")):
        Output(str(tmp_path / "no" / "r.json")).json({})
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]


def test_a_cache_write_that_fails_leaves_no_temporary_file(tmp_path, fsyncs):
    """The remote cache's files (remote.json, the ranks' progress) use the one write: without
    fsync (a cache), and nothing left behind when the write fails. (Its kept lengths and
    values are written by fastload.runtime.kept, tested in test_lengths_cache.py.)"""
    def _save(p, v):
        atomic_write(p, lambda f: np.save(f, v, allow_pickle=False), fsync=False)

    p = tmp_path / "lengths-tokens.npy"
    _save(p, np.arange(5, dtype=np.int64))
    assert np.load(p).tolist() == [0, 1, 2, 3, 4] and fsyncs == []
    with pytest.raises(ValueError):
        _save(p, np.array([object()]))  # np.save refuses objects without pickle, after opening the file
    assert np.load(p).tolist() == [0, 1, 2, 3, 4]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["lengths-tokens.npy"]
