"""A shard truncated while it is memory-mapped (or an I/O error under a mapped page) raises
SIGBUS on the next read of a lost page. The guarded reads — the ring's C++ gather (producer
threads and the consumer helping), the hashing of a shard, the Dataset's batch reads — turn it
into a ShardReadError (a FormatError and an OSError) naming the shard's file, on the read that
needed it; a read outside the guards still dies by SIGBUS as before (the handler chains).

Each case runs in a child process (a SIGBUS that is not caught kills it), forked from the
tests' launcher (tests/_zygote.py: fastload imported, no handler installed yet), with Python's
faulthandler enabled before fastload installs its handler (at its first guarded read), as
under pytest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fastload
from _zygote import run_python

ROOT = Path(__file__).resolve().parent.parent
ROW = 1024  # float32 per row: 4 KiB, so a shard spans many pages
ROWS = 512
SHARD_ROWS = 64  # about: the other fields take room too


@pytest.fixture()
def ds_path(tmp_path):
    """8 shards of 64 rows: x float32[1024] (row i holds i), name string, tok int32[] ragged."""
    path = tmp_path / "ds"
    x = np.repeat(np.arange(ROWS, dtype=np.float32)[:, None], ROW, axis=1)
    with fastload.ShardWriter(path, {"x": f"float32[{ROW}]", "name": "string", "tok": "int32[]"},
                              shard_size=SHARD_ROWS * ROW * 4) as w:
        for i in range(ROWS):
            w.write({"x": x[i], "name": f"n{i}" * 300, "tok": np.full(i % 50 + 1, i, np.int32)})
    ds = fastload.Dataset(path)
    assert ds.num_shards >= 6 and int(ds.shard_sizes[0]) >= 16, ds.shard_sizes
    return path


PRELUDE = """
import faulthandler, os, sys
if os.environ.get("H4_FAULTHANDLER") == "1":
    faulthandler.enable()  # as pytest does, before fastload installs its handler
import numpy as np
import fastload
from fastload.errors import FormatError, ShardReadError

path = sys.argv[1]
def truncate(ds, s, size=4096):
    f = ds.shard_files[s]
    os.truncate(f, size)
    return str(f)
def report(e):
    print("CAUGHT", type(e).__name__, isinstance(e, FormatError), isinstance(e, OSError), getattr(e, "path", None))
    print("MESSAGE", e)
    sys.stdout.flush()
"""

CASES = {
    # the Loader: raw tensor rows gathered by the ring's C++ threads
    "loader": """
ds = fastload.Dataset(path, verify=os.environ["H4_VERIFY"])
starts = np.concatenate([[0], np.cumsum(ds.shard_sizes)])
bad = ds.num_shards - 2
loader = fastload.Loader(ds, batch_size=16, shuffle=False, threads=2, fields=["x"])
it = iter(loader)
first = next(it)
assert float(first["x"][3, 0]) == 3.0
print("TRUNCATED", truncate(ds, bad))
seen = 16
try:
    for b in it:
        idx = b["index"].numpy()
        assert np.array_equal(b["x"].numpy()[:, 7], idx.astype(np.float32))  # batches before it are intact
        assert not np.any((idx >= starts[bad]) & (idx < starts[bad + 1])), "a batch of the truncated shard came out"
        seen += len(idx)
    print("NO ERROR")
except ShardReadError as e:
    report(e)
    print("SEEN", seen, "BAD_START", int(starts[bad]))
loader.close()
print("CLOSED")
""",
    # the Ring alone: the failed batch names its shard, later batches of other shards work
    "ring": """
from fastload.ring.ring import Ring
ds = fastload.Dataset(path, verify="off")
src = [ds.column(s, "x", verify=False) for s in range(ds.num_shards)]
with Ring({"x": (np.float32, (%(ROW)d,))}, 8, {"x": src}, threads=2) as ring:
    name = truncate(ds, 1)
    n1 = int(ds.shard_sizes[1])
    ring.submit(np.full(8, 1), np.arange(n1 - 8, n1))  # its last rows: lost pages
    rows = np.arange(8)
    ring.submit(np.full(8, 0), rows)
    try:
        ring.get()
        print("NO ERROR")
    except ShardReadError as e:
        report(e)
    b = ring.get()["x"].numpy()
    print("LATER BATCH OK", bool(np.array_equal(b[:, 0], rows.astype(np.float32))))
""",
    # hashing a shard (verify) that was truncated after it was mapped
    "hash": """
ds = fastload.Dataset(path, verify="always")
ds.shard(1)  # mapped (and checked structurally), not hashed yet
truncate(ds, 1)
try:
    ds.get_batch([int(ds.shard_sizes[0]) + 5])
    print("NO ERROR")
except ShardReadError as e:
    report(e)
""",
    # the Dataset's reads on the calling thread: fixed, string and ragged fields
    "consumer": """
ds = fastload.Dataset(path, verify="off")
last = int(ds.shard_sizes[0]) + int(ds.shard_sizes[1]) - 1  # the last row of shard 1
for f in ("x", "name", "tok"):
    ds.get_batch([last], fields=[f])  # maps shard 1 and builds its views
truncate(ds, 1)
for f in ("x", "name", "tok"):
    try:
        ds.get_batch([last], fields=[f])
        print("NO ERROR", f)
    except ShardReadError as e:
        report(e)
try:  # the copy the image decoders are fed (views of the mapping would fault in DALI's threads)
    ds.views("name", [last], copy=True)
    print("NO ERROR views")
except ShardReadError as e:
    report(e)
""",
    # encoded images: copied out of the mapping (guarded) before DALI's threads read them
    "images": """
import io
from PIL import Image
img = path + "_img"
rng = np.random.default_rng(0)
with fastload.ShardWriter(img, {"image": "image", "label": "int64"}, shard_size=8 * 40_000) as w:
    for i in range(64):
        b = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (100, 100, 3), dtype=np.uint8)).save(b, "PNG")
        w.write({"image": b.getvalue(), "label": i})
ds = fastload.Dataset(img, verify="off")
assert ds.num_shards >= 4, ds.shard_sizes
loader = fastload.Loader(ds, batch_size=4, shuffle=False, device="cpu", prefetch=2,
                         transforms={"image": fastload.vision.eval(32, resize=32)})
it = iter(loader)
next(it)
bad = ds.num_shards - 1
print("TRUNCATED", truncate(ds, bad))
try:
    for b in it:
        pass
    print("NO ERROR")
except ShardReadError as e:
    report(e)
loader.close()
print("CLOSED")
""",
    # a read outside every guard (numpy on a column view) still dies by SIGBUS
    "unguarded": """
ds = fastload.Dataset(path, verify="off")
col = ds.column(1, "x")
ds.get_batch([0])  # a guarded read first: fastload's handler is installed
truncate(ds, 1)
print("SUM", float(col[-1].sum()))
""",
}


def run_case(case: str, path: Path, faulthandler: bool = True, verify: str = "off") -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(CASES[case] % {"ROW": ROW, "SHARD_ROWS": SHARD_ROWS})
    env = dict(os.environ, PYTHONPATH=str(ROOT), H4_FAULTHANDLER="1" if faulthandler else "0", H4_VERIFY=verify,
               FASTLOAD_CACHE=str(path.parent / "cache"))
    return run_python("-c", script, str(path), timeout=120, env=env, cwd=str(path.parent))


def caught(p: subprocess.CompletedProcess) -> list[str]:
    assert p.returncode >= 0, f"killed by signal {-p.returncode}\n{p.stdout}\n{p.stderr}"
    assert p.returncode == 0, p.stdout + p.stderr
    assert "NO ERROR" not in p.stdout, p.stdout
    return [line for line in p.stdout.splitlines() if line.startswith(("CAUGHT", "MESSAGE"))]


def check_message(lines: list[str], shard_file: str, what: str = "") -> None:
    assert lines[0].split()[:4] == ["CAUGHT", "ShardReadError", "True", "True"], lines
    assert lines[0].endswith(shard_file), lines  # .path
    msg = lines[1]
    assert shard_file in msg and "SIGBUS" in msg and "truncated to 4096 bytes" in msg, msg
    assert "re-convert the dataset" in msg and "fastload verify" in msg, msg
    assert what in msg, msg


@pytest.mark.parametrize("verify", ["off", "first-use"])
def test_a_shard_truncated_under_a_running_loader_fails_its_batch_naming_the_shard(ds_path, verify):
    # verify="off": the ring's gather threads read the lost pages; "first-use": the shard's
    # hash before its first batch does (it was not verified yet)
    p = run_case("loader", ds_path, verify=verify)
    lines = caught(p)
    ds = fastload.Dataset(ds_path, verify="off")
    bad = ds.num_shards - 2
    check_message(lines, str(ds.shard_files[bad]))
    # the hash of its first use (unless verify-ahead hashed it before the truncation)
    assert f", shard {bad} (" in lines[1] or (verify == "first-use" and "hashing the shard (" in lines[1]), lines
    seen = next(line for line in p.stdout.splitlines() if line.startswith("SEEN")).split()
    assert int(seen[1]) <= int(seen[3])  # every batch before the shard's first came out, intact
    assert "CLOSED" in p.stdout


def test_the_ring_fails_only_the_batch_that_read_the_truncated_shard(ds_path):
    p = run_case("ring", ds_path)
    lines = caught(p)
    ds = fastload.Dataset(ds_path, verify="off")
    check_message(lines, str(ds.shard_files[1]), "batch 0, shard 1 (")
    assert "LATER BATCH OK True" in p.stdout


def test_hashing_a_shard_truncated_after_it_was_mapped_raises_naming_it(ds_path):
    p = run_case("hash", ds_path)
    lines = caught(p)
    check_message(lines, str(fastload.Dataset(ds_path, verify="off").shard_files[1]), "hashing the shard")


def test_dataset_reads_of_a_truncated_shard_raise_naming_it(ds_path):
    p = run_case("consumer", ds_path)
    lines = caught(p)
    assert len(lines) == 8, p.stdout  # x, name, tok and the copied views each raised
    f = str(fastload.Dataset(ds_path, verify="off").shard_files[1])
    for k in range(4):
        check_message(lines[2 * k:2 * k + 2], f)


@pytest.mark.parametrize("faulthandler", [True, False])
def test_a_read_outside_the_guards_still_dies_by_sigbus(ds_path, faulthandler):
    p = run_case("unguarded", ds_path, faulthandler)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr)
    assert "SUM" not in p.stdout
    if faulthandler:  # the previous handler (faulthandler's) ran: the chain is intact
        assert "Fatal Python error: Bus error" in p.stderr, p.stderr


def test_a_shard_of_images_truncated_under_a_running_loader_fails_naming_it(ds_path):
    """The encoded bytes go to DALI as a guarded copy, not as views of the mapping."""
    p = run_case("images", ds_path)
    lines = caught(p)
    bad = fastload.Dataset(str(ds_path) + "_img", verify="off")
    check_message(lines, str(bad.shard_files[bad.num_shards - 1]))
    assert "CLOSED" in p.stdout
