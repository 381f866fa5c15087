"""What a batch_transform / device_transform returns is checked (a dict of tensors, each with
the batch's rows along dimension 0; numpy arrays converted; lists only for string fields;
"index" put back), on the host and on the CUDA delivery (fake CUDA), and a transform that
never returns never blocks close() nor the interpreter's exit (issue 27)."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import fastload
from fastload.errors import TransformError
from fastload.loader import threaded


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("tfc") / "ds"
    rng = np.random.default_rng(0)
    with fastload.ShardWriter(path, {"x": "float32[4]", "label": "int64", "t": "int32[]", "name": "string"},
                              shard_size="4KB") as w:
        w.write_batch({"x": rng.standard_normal((100, 4)).astype(np.float32), "label": np.arange(100) % 5,
                       "t": [np.arange(k, dtype=np.int32) for k in rng.integers(1, 9, 100)],
                       "name": [f"s{i}" for i in range(100)]})
    return fastload.Dataset(path)


def first(ds, **kw):
    kw.setdefault("batch_size", 16)
    with fastload.Loader(ds, shuffle=False, **kw) as loader:
        return next(iter(loader))


def refused(ds, match, **kw):
    with pytest.raises(TransformError, match=match) as e:
        first(ds, **kw)
    assert isinstance(e.value, fastload.FastloadError)
    return str(e.value)


# -- what a transform may return --------------------------------------------------------------
def test_numpy_arrays_become_tensors_and_read_only_ones_are_copied(ds):
    ro = np.arange(16, dtype=np.int64)
    ro.flags.writeable = False

    def fn(b):
        return {**b, "y": b["x"].numpy() * 2, "ro": ro}

    b = first(ds, batch_transform=fn)
    assert isinstance(b["y"], torch.Tensor) and torch.equal(b["y"], b["x"] * 2)
    assert isinstance(b["ro"], torch.Tensor) and b["ro"].tolist() == list(range(16))
    assert b["ro"].numpy().flags.writeable  # a copy: torch never writes into a read-only array


def test_a_value_that_is_no_tensor_is_refused_naming_the_key_and_the_batch(ds):
    msg = refused(ds, r"returned 'names' as a list of 16 items, not a tensor",
                  batch_transform=lambda b: {**b, "names": [str(i) for i in b["index"].tolist()]})
    assert "stream position 0 of epoch 0 (16 rows), samples 0, 1, 2" in msg and "batch_transform " in msg and "<lambda> returned" in msg
    refused(ds, r"returned 'n' as a int \(3\), not a tensor", batch_transform=lambda b: {**b, "n": 3})
    refused(ds, r"returned 'meta' as a dict", batch_transform=lambda b: {**b, "meta": {"a": 1}})
    refused(ds, r"returned 'o' as a numpy array of dtype object",
            batch_transform=lambda b: {**b, "o": np.array([None] * 16, dtype=object)})


def test_string_fields_stay_lists_of_one_item_per_row(ds):
    b = first(ds, fields=["x", "name"], batch_transform=lambda b: {**b, "name": [s.upper() for s in b["name"]]})
    assert b["name"] == [f"S{i}" for i in range(16)]
    refused(ds, r"returned 'name' as a list of 15 items, not the batch's 16", fields=["x", "name"],
            batch_transform=lambda b: {**b, "name": b["name"][1:]})


def test_a_tensor_with_other_rows_than_the_batch_is_refused(ds):
    msg = refused(ds, r"returned 'x' with 3 rows along dimension 0 \(shape \(3, 4\)\), not the batch's 16",
                  batch_transform=lambda b: {**b, "x": b["x"][:3]})
    assert "stream position 0" in msg
    refused(ds, r"returned 'extra' with 17 rows", batch_transform=lambda b: {**b, "extra": torch.zeros(17)})
    refused(ds, r"returned 'loss_scale' as a 0-d tensor \(2.0\)",
            batch_transform=lambda b: {**b, "loss_scale": torch.tensor(2.0)})
    # x with 3 rows beside an index with 32 (the case), in the batch at position 32
    with fastload.Loader(ds, batch_size=32, shuffle=False,
                         batch_transform=lambda b: {**b, "x": b["x"][:3]} if b["index"][0] == 32 else b) as lo:
        it = iter(lo)
        assert len(next(it)["x"]) == 32
        with pytest.raises(TransformError, match=r"'x' with 3 rows .* stream position 32 of epoch 0 \(32 rows\)"):
            next(it)


def test_index_is_put_back_when_left_out_and_checked_when_changed(ds):
    b = first(ds, batch_transform=lambda b: {"y": b["x"] + 1})
    assert sorted(b) == ["index", "y"] and b["index"].tolist() == list(range(16))
    refused(ds, r"returned 'index' with 8 rows", batch_transform=lambda b: {**b, "index": b["index"][:8]})


def test_device_transform_on_the_cpu_is_checked_alike(ds):
    refused(ds, r"device_transform .*<lambda> returned 'x' with 2 rows", device_transform=lambda b: {**b, "x": b["x"][:2]})
    b = first(ds, device_transform=lambda b: {**b, "z": np.ones(16, np.float32)})
    assert isinstance(b["z"], torch.Tensor)


def test_packed_ragged_keys_may_have_their_own_lengths_and_new_per_token_values(ds):
    """ragged="packed": tokens (T,) and tokens_offsets (B + 1,) are exempt; a new key may have
    T rows (per-token values) or B rows; any other length is refused."""
    def per_token(b):
        return {**b, "labels": torch.roll(b["t"], -1), "w": torch.ones(len(b["index"]))}

    b = first(ds, fields=["t"], ragged="packed", batch_transform=per_token)
    assert len(b["labels"]) == len(b["t"]) == int(b["t_offsets"][-1]) and len(b["w"]) == 16
    b = first(ds, fields=["t"], ragged="packed", batch_transform=lambda b: {**b, "t": b["t"][:5]})
    assert len(b["t"]) == 5  # a transform may re-pack: the packed keys are not row-aligned
    refused(ds, r"returned 'bad' with 1 rows", fields=["t"], ragged="packed",
            batch_transform=lambda b: {**b, "bad": torch.zeros(1)})
    # padded ragged fields are per row like every other field
    refused(ds, r"returned 't' with 15 rows", fields=["t"], batch_transform=lambda b: {**b, "t": b["t"][1:]})


def test_pack_to_rows_of_tokens(ds):
    """pack_to: index and the other fields have one row per piece, tokens and tokens_positions
    one per token row; a new key may have either length."""
    def labels(b):
        return {**b, "labels": torch.roll(b["t"], -1, dims=1), "doc_w": torch.ones(len(b["index"]))}

    b = first(ds, fields=["t", "label"], batch_size=2, pack_to=16, batch_transform=labels)
    assert b["labels"].shape == b["t"].shape == (2, 16) and len(b["doc_w"]) == len(b["index"]) > 2
    refused(ds, r"returned 'label' with 2 rows", fields=["t", "label"], batch_size=2, pack_to=16,
            batch_transform=lambda b: {**b, "label": b["label"][:2]})


def test_a_mixture_s_source_is_put_back_and_errors_name_dataset_and_index(ds, tmp_path):
    with fastload.ShardWriter(tmp_path / "b", {"x": "float32[4]", "label": "int64"}) as w:
        w.write_batch({"x": np.zeros((20, 4), np.float32), "label": np.zeros(20, np.int64)})
    kw = dict(mix=[0.5, 0.5], epoch_size=64, batch_size=8, seed=2, fields=["x", "label"])
    with fastload.Loader([ds, fastload.Dataset(tmp_path / "b")], batch_transform=lambda b: {"x": b["x"]}, **kw) as lo:
        b = next(iter(lo))
    assert sorted(b) == ["index", "source", "x"] and len(b["source"]) == 8
    with fastload.Loader([ds, fastload.Dataset(tmp_path / "b")], batch_transform=lambda b: {**b, "x": b["x"][:1]},
                         **kw) as lo, pytest.raises(TransformError, match=r"samples \(dataset:index\) [01]:\d+"):
        next(iter(lo))


# -- the CUDA delivery (fake CUDA: the ``fake`` fixture of conftest.py) ------------------------
def test_cuda_device_transform_is_checked_and_its_errors_name_the_batch(fake, ds):
    kw = dict(fields=["x", "label"], device="cuda:1")
    b = first(ds, device_transform=lambda b: {"x": b["x"]}, **kw)
    assert sorted(b) == ["index", "x"] and b["index"].is_cuda and b["x"].device == torch.device("cuda", 1)
    refused(ds, r"device_transform .*<lambda> returned 'x' with 3 rows .* stream position 0",
            device_transform=lambda b: {**b, "x": b["x"][:3].to(b["x"].device)}, **kw)
    refused(ds, r"returned 'y' as a numpy array \(on the host\); a device_transform returns tensors on cuda:1",
            device_transform=lambda b: {**b, "y": np.zeros(16)}, **kw)
    refused(ds, r"returned 'y' on cpu, not on the loader's device cuda:1",
            device_transform=lambda b: {**b, "y": torch.zeros(16)}, **kw)
    refused(ds, r"returned 'x' as a list", device_transform=lambda b: {**b, "x": [0] * 16}, **kw)
    msg = refused(ds, r"device_transform .*boom failed on the batch at stream position 0 of epoch 0, samples 0, 1",
                  device_transform=boom, **kw)
    assert "ZeroDivisionError" in msg
    # the batch_transform's numpy array is a tensor before the copy: it arrives on the GPU
    b = first(ds, batch_transform=lambda b: {**b, "y": np.ones(16, np.float32)}, **kw)
    assert b["y"].is_cuda and b["y"].cpu().tolist() == [1.0] * 16


def boom(batch):
    return 1 / 0


def test_cuda_device_transform_gets_its_info_as_on_the_cpu(fake, ds):
    seen = []

    def with_info(batch, info):
        seen.append((info.position, info.index.tolist()[:2]))
        return batch

    first(ds, fields=["x"], device="cuda:1", device_transform=with_info)
    assert seen[0] == (0, [0, 1])


# -- a transform that never returns ---------------------------------------------------------
def test_close_returns_within_its_deadline_naming_the_stuck_transform(ds, monkeypatch, caplog):
    monkeypatch.setattr(threaded, "CLOSE_TIMEOUT_S", 0.5)
    release = threading.Event()
    entered = threading.Event()

    def stuck(b):
        if b["index"][0] >= 16:
            entered.set()
            release.wait()
        return b

    lo = fastload.Loader(ds, batch_size=16, shuffle=False, fields=["x"], batch_transform=stuck)
    try:
        it = iter(lo)
        assert next(it)["index"][0] == 0
        assert entered.wait(10)  # the thread is inside stuck() (not between batches) at close()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            lo.close()
        took = time.monotonic() - t0
        assert took < 0.5 + 3, took
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert "batch_transform" in msg and "stuck" in msg and "stream position 16" in msg, msg
        assert "test_batch_transform_checks.py" in msg and "did not return within" in msg
        stuck_threads = [t for t in threading.enumerate() if t.name == "fastload-transform"]
        assert stuck_threads and all(t.daemon for t in stuck_threads)
    finally:
        release.set()  # the abandoned thread then ends (it sees the stop flag)
    for t in stuck_threads:
        t.join(5)
        assert not t.is_alive()


def test_get_warns_when_a_batch_takes_very_long(ds, monkeypatch, caplog):
    monkeypatch.setattr(threaded, "WAIT_WARN_S", 0.3)

    def slow(b):
        if b["index"][0] == 16:
            time.sleep(1.0)
        return b

    with fastload.Loader(ds, batch_size=16, shuffle=False, fields=["x"], batch_transform=slow, prefetch=2) as lo:
        with caplog.at_level(logging.WARNING, logger="fastload"):
            got = [int(b["index"][0]) for b in lo]
    assert got == list(range(0, 100, 16))
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "waited" in msg and "slow" in msg and "stream position 16" in msg, msg


SCRIPT = """
import sys, threading, time, logging
logging.basicConfig(level=logging.WARNING)
import fastload
from fastload.loader import threaded
threaded.CLOSE_TIMEOUT_S = 1.0
never = threading.Event()
entered = threading.Event()

def stuck(b):
    if b["index"][0] >= 16:
        entered.set()
        never.wait()  # blocks forever
    return b

loader = fastload.Loader(sys.argv[1], batch_size=16, shuffle=False, fields=["x"], batch_transform=stuck)
it = iter(loader)
next(it)
assert entered.wait(10)  # the thread is inside stuck(), not between batches
if sys.argv[2] == "close":
    t0 = time.monotonic()
    loader.close()
    print(f"closed in {time.monotonic() - t0:.2f} s", flush=True)
print("end of script", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_the_process_exits_with_a_transform_blocked_forever(ds, tmp_path, how):
    """After close() (or with the Loader still open at the end of the script) the interpreter
    exits: close() gives up on the thread after CLOSE_TIMEOUT_S, and the thread is a daemon."""
    (tmp_path / "s.py").write_text(textwrap.dedent(SCRIPT))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(tmp_path / "s.py"), str(ds.path), how], capture_output=True,
                       text=True, timeout=90)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    assert "end of script" in p.stdout and took < 60, (took, p.stdout, p.stderr)
    if how == "close":
        closed = float(p.stdout.split("closed in ")[1].split()[0])
        assert closed < 1.0 + 3, closed
    assert "did not return within 1 s" in p.stderr and "stream position 16" in p.stderr, p.stderr


def test_a_stuck_device_transform_on_cuda_does_not_block_close(fake, ds, monkeypatch, caplog):
    monkeypatch.setattr(threaded, "CLOSE_TIMEOUT_S", 0.5)
    release = threading.Event()
    entered = threading.Event()

    def stuck_on_gpu(b):
        if b["index"].cpu()[0] >= 16:
            entered.set()
            release.wait()
        return b

    lo = fastload.Loader(ds, batch_size=16, shuffle=False, fields=["x"], device="cuda:1",
                         device_transform=stuck_on_gpu)
    try:
        it = iter(lo)
        assert next(it)["index"].cpu()[0] == 0
        assert entered.wait(10)  # the thread is inside stuck_on_gpu() at close()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fastload"):
            lo.close()
        assert time.monotonic() - t0 < 0.5 + 3
        msg = " ".join(r.getMessage() for r in caplog.records)
        assert "device_transform" in msg and "stuck_on_gpu" in msg and "stream position 16" in msg, msg
        stuck_threads = [t for t in threading.enumerate() if t.name == "fastload-transform"]
    finally:
        release.set()
    for t in stuck_threads:
        t.join(5)
        assert not t.is_alive()
