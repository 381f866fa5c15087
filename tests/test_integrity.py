"""Never silently wrong: checked shards, a validated manifest, readers that keep the dataset they
opened (issue 19, "Silent wrong data" and "Manifest and arguments").

Property tests flip random bytes (fixed seeds) in shards, their footers and the manifest: every
outcome is either the very same batches or a named fastload error, never different data and
never another exception.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import fastload
from _zygote import run_python
from fastload.errors import FastloadError, FormatError, MissingFileError
from fastload.store import verified_record
from fastload.store.verified_record import VerifiedRecord

N = 300


def _raw(path, n=N, shard_size=2000, seed=0):
    rng = np.random.default_rng(seed)
    with fastload.ShardWriter(path, {"x": "float32[4]", "label": "int64"}, label="label", shard_size=shard_size) as w:
        w.write_batch({"x": rng.standard_normal((n, 4)).astype(np.float32), "label": np.arange(n) % 3},
                      keys=[f"{i:06d}" for i in range(n)])  # equal-size shards
    return path


def _images(path, n=24):
    from PIL import Image
    rng = np.random.default_rng(1)
    with fastload.ShardWriter(path, {"image": "image", "label": "int64"}, label="label", shard_size=20_000) as w:
        for i in range(n):
            b = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(b, "JPEG", quality=90)
            w.write({"image": b.getvalue(), "label": i % 2})
    return path


def _batches(path, **kw):
    """Every batch of one unshuffled epoch, as numpy."""
    with fastload.Loader(path, batch_size=64, shuffle=False, device="cpu", **kw) as loader:
        return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))


def _manifest(path):
    """The manifest, to be edited by hand: without its ``manifest_checksum`` (as a manifest
    written before that key existed), so the checks past the checksum are the ones tested
    (tests/test_store_manifest_checksum.py tests the checksum)."""
    m = json.loads((path / "manifest.json").read_text())
    m.pop("manifest_checksum", None)
    return m


# -- the verification policy ------------------------------------------------------------------
def test_a_flipped_byte_is_refused_before_any_row_of_its_shard_is_delivered(tmp_path):
    d = _raw(tmp_path / "ds")
    ref = _batches(d)
    shard = d / _manifest(d)["shards"][1]["file"]
    x1 = fastload.Dataset(d).column(1, "x")[3].tobytes()  # a row's bytes: flip one of them in the file
    _flip(shard, shard.read_bytes().index(x1) + 2)
    with pytest.raises(FormatError, match=f"{shard.name} does not match the manifest: its checksum"):
        _batches(d)
    ds = fastload.Dataset(d)
    assert ds.get_batch([0])["x"].tolist() == [ref[0]["x"][0].tolist()]  # shard 0 is fine
    with pytest.raises(FormatError, match=shard.name):
        ds.get_batch([ds.shard_starts[1]])
    with pytest.raises(FormatError, match=shard.name):  # and again: the verdict is kept
        ds.column(1, "x")
    # off: no hashing, the structure alone is checked (a same-size flip in the data passes)
    got = _batches(d, verify="off")
    assert not _same(got, ref) and len(got) == len(ref)


def test_shards_are_hashed_once_per_node_and_again_when_the_file_changes(tmp_path, monkeypatch):
    # (the shards were written just now: the racy-clean window would keep them out of the
    # record; test_a_shard_changed_just_before_it_was_hashed_is_not_remembered tests it)
    monkeypatch.setattr(verified_record, "RACY_WINDOW_S", 0.0)
    d = _raw(tmp_path / "ds")
    ds = fastload.Dataset(d)
    ds.get_batch(np.arange(N))
    s = ds.verify_stats()
    assert s["policy"] == "first-use" and s["shards_hashed"] == ds.num_shards and s["shards_remembered"] == 0
    ds2 = fastload.Dataset(d)  # a restart on the same node: nothing hashed again
    ds2.get_batch(np.arange(N))
    assert ds2.verify_stats()["shards_hashed"] == 0 and ds2.verify_stats()["shards_remembered"] == ds.num_shards
    with fastload.Loader(d, batch_size=50, device="cpu") as loader:
        for _ in loader:
            pass
        assert loader.stats()["verify"]["shards_hashed"] == 0
    # "always" ignores the record; "off" hashes nothing
    ds3 = fastload.Dataset(d, verify="always")
    ds3.get_batch(np.arange(N))
    assert ds3.verify_stats()["shards_hashed"] == ds.num_shards
    ds4 = fastload.Dataset(d, verify="off")
    ds4.get_batch(np.arange(N))
    assert ds4.verify_stats()["shards_hashed"] == 0
    # the same bytes written again (a restore, a copy): a new identity, hashed again
    f = d / _manifest(d)["shards"][0]["file"]
    f.write_bytes(f.read_bytes())
    ds5 = fastload.Dataset(d)
    ds5.get_batch([0])
    assert ds5.verify_stats()["shards_hashed"] == 1
    # verify (the command) fills the record too
    rec = VerifiedRecord()
    shutil.rmtree(rec.dir)
    assert fastload.verify(d) == []
    ds6 = fastload.Dataset(d)
    ds6.get_batch(np.arange(N))
    assert ds6.verify_stats()["shards_hashed"] == 0


def test_a_loaders_first_batch_waits_only_for_its_own_shards_the_rest_are_hashed_ahead(tmp_path, monkeypatch):
    """With a full shuffle, the first run of batches in flight touches most shards: the first
    batch waits only for the shards it reads; background threads hash the others in the
    order the requested batches need them, then the rest of the dataset in index order."""
    import threading

    from fastload.store import first_use

    d = tmp_path / "ds"
    with fastload.ShardWriter(d, {"x": "int64"}, shard_size=80) as w:  # 10 samples a shard
        w.write_batch({"x": np.arange(400)})
    with fastload.Loader(d, batch_size=4, device="cpu", verify="off") as loader:
        ref = [b["x"].numpy().copy() for b in loader]
    gate = threading.Event()
    monkeypatch.setattr(first_use, "lower_priority", lambda: gate.wait(30))  # background threads start held
    order = []
    check = first_use.ShardVerifier._check

    def recording(self, ids, map_shard, **kw):
        if threading.current_thread().name == "fastload-verify-ahead":
            order.extend(ids)
        return check(self, ids, map_shard, **kw)

    monkeypatch.setattr(first_use.ShardVerifier, "_check", recording)
    ds = fastload.Dataset(d, verify="always")
    ds._verifier.ahead_workers = 1  # one background thread: its order is the order asked for
    with fastload.Loader(ds, batch_size=4, device="cpu") as loader:
        it = iter(loader)
        first = next(it)
        shards = lambda x: np.asarray(x) // 10  # noqa: E731 - sample -> shard (10 a shard)
        assert set(np.flatnonzero(ds._verifier.verified)) == set(shards(first["x"]).tolist())
        assert ds.verify_stats()["shards_hashed"] == len(set(shards(first["x"]).tolist()))
        gate.set()  # the background hashes the rest while the loop holds on to the first batch
        deadline = time.monotonic() + 60
        while not ds.fully_verified and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ds.fully_verified
        got = [first["x"].numpy().copy()] + [b["x"].numpy().copy() for b in it]
    assert _same([{"x": g} for g in got], [{"x": r} for r in ref])
    run = np.concatenate(ref[:loader.prefetch])  # the batches requested with the first one
    uniq, at = np.unique(shards(run), return_index=True)
    asked = [int(s) for s in uniq[np.argsort(at)] if s not in set(shards(ref[0]).tolist())]
    assert len(asked) > 10 and order[:len(asked)] == asked  # first-use order
    rest = order[len(asked):]
    assert rest == sorted(rest) and not set(rest) & set(asked)  # then the others, in index order
    assert ds.verify_stats()["shards_hashed_ahead"] == len(order) > 0
    # With every shard verified the background threads end by themselves (a normal end of the
    # pass need not join them): one may still be leaving its loop just after fully_verified.
    verifying = lambda: [t for t in threading.enumerate() if t.name == "fastload-verify-ahead"]  # noqa: E731
    deadline = time.monotonic() + 10
    while verifying() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not verifying()


def test_hashing_many_bytes_says_so_once_with_how_to_avoid_it(tmp_path, monkeypatch, caplog):
    from fastload.store import first_use

    d = _raw(tmp_path / "ds")
    monkeypatch.setattr(first_use, "ANNOUNCE_BYTES", 1000)  # "many" bytes for this small dataset
    n = len(_manifest(d)["shards"])
    total = sum(s["bytes"] for s in _manifest(d)["shards"])
    with caplog.at_level("INFO", logger="fastload"):
        _batches(d)
        _batches(d, verify="always")
    lines = [r.getMessage() for r in caplog.records if "before first use" in r.getMessage()]
    assert len(lines) == 2 and lines[0] == lines[1]  # one per reader
    assert f"up to {n} shards ({total / 1e9:.1f} GB)" in lines[0]
    assert f"fastload verify {d}" in lines[0] and 'verify="off"' in lines[0]
    assert all(r.levelname == "WARNING" for r in caplog.records if "before first use" in r.getMessage())
    caplog.clear()
    monkeypatch.setattr(first_use, "ANNOUNCE_BYTES", 10 * total)
    with caplog.at_level("INFO", logger="fastload"):
        _batches(d, verify="always")
    assert not [r for r in caplog.records if "before first use" in r.getMessage()]


def _holder(lock_path):
    """A process that takes a shard's verification lock and then never finishes (as a rank
    stopped with Ctrl-Z, or stuck on a dead NFS server, would)."""
    code = (f"import fcntl, os, time\nfd = os.open({str(lock_path)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_process_holding_a_shards_lock_delays_other_readers_only_until_the_deadline(tmp_path):
    d = _raw(tmp_path / "ds")
    ds = fastload.Dataset(d, verify="off")
    rec = VerifiedRecord()
    key = rec.key(ds.shard(0).mm, _manifest(d)["shards"][0]["checksum"])
    lock = rec._lock_path(key)
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = _holder(lock)
    try:
        script = f"""
            import logging, time, fastload
            logging.basicConfig(level=logging.WARNING, format="%(message)s")
            t0 = time.perf_counter()
            x = fastload.Dataset({str(d)!r}).get_batch([0, 1])["x"]
            print(round(time.perf_counter() - t0, 2), x.tolist() == {ds.get_batch([0, 1])["x"].tolist()!r})
        """
        env = dict(os.environ, FASTLOAD_VERIFY_LOCK_TIMEOUT="0.5")
        p = run_python("-c", textwrap.dedent(script), timeout=120, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        took, same = p.stdout.split()
        assert same == "True" and float(took) < 20  # the tiny shard: 0.5 s, plus start-up
        lines = [ln for ln in p.stderr.splitlines() if "verification lock" in ln]
        assert len(lines) == 1 and _manifest(d)["shards"][0]["file"] in lines[0], p.stderr
        assert "without the lock" in lines[0]
        # in-process: the context manager says it goes on without the lock
        t0 = time.perf_counter()
        with VerifiedRecord(lock_timeout_s=0.2).locked(key) as held:
            assert held is False
        assert 0.15 < time.perf_counter() - t0 < 10
    finally:
        holder.kill()
        holder.wait()
    with VerifiedRecord(lock_timeout_s=0.2).locked(key) as held:  # the holder is gone: the lock is free
        assert held is True
        assert lock.exists()
    assert not lock.exists()  # lock files are removed after use


def test_the_lock_handoff_survives_lock_files_being_removed(tmp_path):
    """Lock files are removed on release; a waiter that opened the removed file must not
    think it holds the lock while another process holds the path's new file."""
    import threading

    rec = VerifiedRecord(tmp_path / "cache", lock_timeout_s=5)
    key = "ab" + "0" * 62
    results, got, release = [], threading.Event(), threading.Event()

    def waiter():
        with rec.locked(key) as held:
            results.append(held)
            got.set()
            release.wait(10)

    t = threading.Thread(target=waiter)
    with rec.locked(key) as held:
        assert held
        t.start()
        time.sleep(0.3)
        assert not got.is_set()  # waiting for us
    assert got.wait(10) and results == [True]
    try:  # the waiter holds the path's current file: a third comer waits (and times out)
        with VerifiedRecord(tmp_path / "cache", lock_timeout_s=0.2).locked(key) as held:
            assert held is False
    finally:
        release.set()
        t.join(10)
    assert not rec._lock_path(key).exists()


NO_HOME = """
    import logging, os, pathlib, sys
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    def no_home(*a, **k):
        raise RuntimeError("Could not determine home directory")
    pathlib.Path.home = classmethod(no_home)  # HOME unset and no passwd entry (an arbitrary container UID)
    import fastload
    from fastload.store import verified_record
    verified_record.RACY_WINDOW_S = 0.0  # (the dataset was written just now)
    for _ in range(2):
        ds = fastload.Dataset(sys.argv[1])
        assert ds.get_batch(list(range(300)))["label"].tolist()[::299] == [0, 2]
        print(ds.verify_stats()["shards_hashed"], ds.verify_stats()["shards_remembered"])
    print(verified_record.cache_root())
"""


def test_no_home_directory_falls_back_to_xdg_or_a_private_temporary_directory(tmp_path):
    d = _raw(tmp_path / "ds")
    n = len(_manifest(d)["shards"])
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "FASTLOAD_CACHE", "XDG_CACHE_HOME")}

    def run(**extra):
        p = run_python("-c", textwrap.dedent(NO_HOME), d, timeout=120, env={**env, **extra})
        assert p.returncode == 0, p.stderr[-2000:]
        assert "Traceback" not in p.stderr
        return p.stdout.split("\n"), p.stderr

    out, err = run(XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert out[:3] == [f"{n} 0", f"0 {n}", str(tmp_path / "xdg" / "fastload")]
    assert len(list((tmp_path / "xdg" / "fastload" / "verified").rglob("*"))) > n
    assert err.count("no home directory") == 1
    out, err = run(TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    out, err = run(TMPDIR=str(tmp_path / "tmp"))
    private = tmp_path / "tmp" / f"fastload-{os.getuid()}"
    assert out[:3] == [f"{n} 0", f"0 {n}", str(private)] and (private.stat().st_mode & 0o777) == 0o700
    # a directory of that name someone else could write (a shared /tmp): not used, nothing remembered
    private.chmod(0o777)
    out, err = run(TMPDIR=str(tmp_path / "tmp"))
    assert out[:3] == [f"{n} 0", f"{n} 0", "None"] and "is not kept" in err


def test_a_shard_changed_just_before_it_was_hashed_is_not_remembered(tmp_path, monkeypatch):
    """git's racy-clean rule: where timestamps are coarse (no multigrain timestamps before
    Linux 6.13, 1-2 s on some file systems), a second write in the same tick keeps the file's
    identity, so a record made within that tick could vouch for bytes it never hashed."""
    # Phase 1, a window no machine's slowness can outlast: hashed within it, not remembered.
    monkeypatch.setattr(verified_record, "RACY_WINDOW_S", 1e6)
    d = _raw(tmp_path / "ds")
    n = len(_manifest(d)["shards"])
    for _ in range(2):  # hashed within the window of the shards' writes: not remembered
        ds = fastload.Dataset(d)
        ds.get_batch(np.arange(N))
        assert (ds.verify_stats()["shards_hashed"], ds.verify_stats()["shards_remembered"]) == (n, 0)
    # Phase 2: a 1 s window, and more than 1 s since the last write (only a lower bound on time).
    monkeypatch.setattr(verified_record, "RACY_WINDOW_S", 1.0)
    time.sleep(1.1)
    ds = fastload.Dataset(d)
    ds.get_batch(np.arange(N))
    assert ds.verify_stats()["shards_hashed"] == n  # now old enough: remembered ...
    ds = fastload.Dataset(d)
    ds.get_batch(np.arange(N))
    assert (ds.verify_stats()["shards_hashed"], ds.verify_stats()["shards_remembered"]) == (0, n)  # ... and trusted
    assert fastload.verify(d) == []  # `verify` follows the same rule (nothing new to remember here)


def test_the_record_prunes_entries_of_gone_or_changed_files(tmp_path, monkeypatch):
    monkeypatch.setattr(verified_record, "RACY_WINDOW_S", 0.0)
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    rec = VerifiedRecord()
    keep, gone, changed = (_raw(tmp_path / name) for name in ("keep", "gone", "changed"))
    for d in (keep, gone, changed):
        fastload.Dataset(d).get_batch(np.arange(N))
    entries = lambda: sorted(p for p in rec.dir.glob("??/*") if not p.name.endswith((".lock", ".tmp")))  # noqa: E731
    n = len(_manifest(keep)["shards"])
    assert len(entries()) == 3 * n and not list(rec.dir.glob("??/*.lock"))  # no lock file is left behind
    shutil.rmtree(gone)
    f = changed / _manifest(changed)["shards"][0]["file"]
    f.write_bytes(f.read_bytes())  # the same bytes, a new identity: its old entry can never match again
    hours_ago = time.time() - 2 * 3600
    stale, held = rec.dir / "ab" / "ab12.lock", rec.dir / "ab" / "ab34.lock"  # left by killed processes
    stale.parent.mkdir(exist_ok=True)
    for p in (stale, held):
        p.write_text("")
        os.utime(p, (hours_ago, hours_ago))
    assert rec.maybe_prune() == 0  # pruned when the record was first written: not again the same day
    days_ago = time.time() - 2 * 86400
    os.utime(rec.dir / ".pruned", (days_ago, days_ago))
    assert rec.prune(max_seconds=-1) == 0  # a time budget: a huge record is pruned a part at a time
    holder = _holder(held)
    try:
        assert rec.maybe_prune() == n + 1 + 1  # the gone dataset's, the changed shard's, the stale lock
    finally:
        holder.kill()
        holder.wait()
    assert held.exists() and not stale.exists()  # a lock some process holds stays
    assert len(entries()) == 2 * n - 1
    assert rec.maybe_prune() == 0
    ds = fastload.Dataset(keep)
    ds.get_batch(np.arange(N))
    assert ds.verify_stats()["shards_remembered"] == n  # live entries were kept
    ds = fastload.Dataset(changed)
    ds.get_batch(np.arange(N))
    assert ds.verify_stats()["shards_hashed"] == 1


def test_swapped_or_relinked_shards_are_refused(tmp_path):
    d = _raw(tmp_path / "ds")
    other = _raw(tmp_path / "other", seed=5)  # same layout, other values: equal-size shards
    ref = _batches(d)
    m = _manifest(d)
    a, b = (d / m["shards"][i]["file"] for i in (0, 1))
    assert a.stat().st_size == b.stat().st_size
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    with pytest.raises(FormatError, match="does not match the manifest"):
        _batches(d)
    a.write_bytes(a_bytes)
    b.write_bytes(b_bytes)
    assert _same(_batches(d), ref)
    b.unlink()
    b.symlink_to(other / _manifest(other)["shards"][1]["file"])  # a shard linked into another dataset
    with pytest.raises(FormatError, match="does not match the manifest"):
        _batches(d)
    assert any("checksum mismatch" in p for p in fastload.verify(d))


@pytest.mark.parametrize("policy", ["first-use", "off"])
def test_random_byte_flips_in_shards_and_footers_give_the_same_batches_or_a_named_error(tmp_path, policy):
    d = _raw(tmp_path / "ds", n=200, shard_size=1500)
    ref = _batches(d)
    files = [d / s["file"] for s in _manifest(d)["shards"]]
    rng = np.random.default_rng(19)
    outcomes = {"same": 0, "error": 0, "different": 0}
    for trial in range(30):
        f = files[int(rng.integers(len(files)))]
        orig = f.read_bytes()
        n = len(orig)
        # half the flips in the footer (schema, record batch offsets), half anywhere
        off = int(rng.integers(max(0, n - 400), n)) if trial % 2 else int(rng.integers(n))
        _flip(f, off)
        try:
            got = _batches(d, verify=policy)
            outcomes["same" if _same(got, ref) else "different"] += 1
        except FastloadError as e:
            assert f.name in str(e), e  # the error names the shard
            outcomes["error"] += 1
        finally:
            f.write_bytes(orig)
    if policy == "first-use":  # a flip always changes the checksum: always refused
        assert outcomes == {"same": 0, "error": 30, "different": 0}
    else:  # off: structure only, never a crash or a foreign exception (data flips pass unseen)
        assert outcomes["error"] > 0 and sum(outcomes.values()) == 30
    assert _same(_batches(d), ref)


@pytest.mark.slow
def test_byte_flips_in_an_image_dataset_are_refused_not_decoded_differently(tmp_path):
    d = _images(tmp_path / "ds")
    t = {"image": fastload.vision.eval(32, resize=36)}
    ref = _batches(d, transforms=t)
    files = [d / s["file"] for s in _manifest(d)["shards"]]
    rng = np.random.default_rng(7)
    for _ in range(6):
        f = files[int(rng.integers(len(files)))]
        orig = f.read_bytes()
        _flip(f, int(rng.integers(len(orig))))
        try:
            with pytest.raises(FormatError, match=f.name):
                _batches(d, transforms=t)
        finally:
            f.write_bytes(orig)
    assert _same(_batches(d, transforms=t), ref)


# -- the manifest --------------------------------------------------------------------------
BAD_MANIFESTS = [
    ("shards", None, "shards must be a list"),
    ("shards", {"a": 1}, "shards must be a list"),
    ("shards.0.file", None, r"shards\[0\].file must be a plain shard file name"),
    ("shards.0.file", 7, r"shards\[0\].file must be a plain shard file name"),
    ("shards.0.file", "../../etc/passwd", r"shards\[0\].file must be a plain shard file name"),
    ("shards.0.file", "/etc/passwd", r"shards\[0\].file must be a plain shard file name"),
    ("shards.0.file", "../other/shard-00000.arrow", r"shards\[0\].file must be a plain shard file name"),
    ("shards.0.file", "shard-00001.arrow", r"shards\[1\].file names 'shard-00001.arrow' a second time"),
    ("shards.0.num_samples", "12", r"shards\[0\].num_samples must be an integer >= 0"),
    ("shards.0.num_samples", True, r"shards\[0\].num_samples must be an integer >= 0"),
    ("shards.0.num_samples", 1.5, r"shards\[0\].num_samples must be an integer >= 0"),
    ("shards.0.bytes", -3, r"shards\[0\].bytes must be an integer >= 1"),
    ("shards.0.checksum", "md5:abc", r"shards\[0\].checksum must be 'xxh3_128:'"),
    ("shards.0.-num_samples", None, r"shards\[0\].num_samples is missing"),
    ("shards.0.-file", None, r"shards\[0\].file is missing"),
    ("num_samples", 5, "num_samples is 5, but the shards hold"),
    ("num_samples", "300", "num_samples must be an integer"),
    ("fields", [["x", "float32[4]"]], "fields must be an object"),
    ("fields", {}, "fields must name at least one field"),
    ("fields.x.kind", "sparse", r"fields\['x'\] is not a valid field description"),
    ("fields.x.shape", ["4"], r"fields\['x'\] is not a valid field description"),
    ("fields.x.shape", [4.0], r"fields\['x'\] is not a valid field description"),
    ("fields.x.shape", 4, r"fields\['x'\] is not a valid field description"),
    ("fields.x.dtype", "float", r"fields\['x'\] is not a valid field description"),
    ("fields.x.-shape", None, r"fields\['x'\] is not a valid field description"),
    ("fields.x", "float32[4]", r"fields\['x'\] is not a valid field description"),
    ("label.counts", "garbage", "label.counts must be a list of integers"),
    ("label.counts", [1, 2], "label.counts add up to 3"),
    ("label.counts", [100, 100, -100, 200], "label.counts must be a list of integers >= 0"),
    ("label.field", "x", "label.field must name an integer scalar field"),
    ("label.class_names", [1, 2, 3], "label.class_names must be a list of strings"),
    ("label", [], "label must be an object"),
    ("total_bytes", 1, "total_bytes is 1, but the shards' bytes add up to"),
    ("metadata", "x", "metadata must be an object"),
    ("format_version", True, "format_version True"),
    ("-fields", None, "fields is missing"),
]


def _set(m, path, value):
    keys = path.split(".")
    node = m
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if last.startswith("-"):
        del node[last[1:]]
    else:
        node[int(last) if isinstance(node, list) else last] = value


@pytest.mark.parametrize("path,value,message", BAD_MANIFESTS)
def test_a_malformed_manifest_is_refused_naming_the_key(tmp_path, path, value, message, capsys):
    d = _raw(tmp_path / "ds")
    m = _manifest(d)
    m["shards"][1]["file"] = m["shards"][1]["file"]  # (shards[1] exists for the duplicate case)
    _set(m, path, value)
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=message):
        fastload.Dataset(d)
    with pytest.raises(FormatError, match=message):
        fastload.verify(d)
    from fastload.cli import main
    assert main(["verify", str(d)]) == 1 and main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 2


def _every_reader(d, ref=None, ref_batches=None):
    """Open the dataset at ``d`` every way a user can: Dataset.get_batch, `fastload inspect`
    (text and --json), `fastload verify` and a Loader's epoch. Each must give the very data of
    ``ref`` / ``ref_batches`` (when given), exit 0/1 with one line, or raise a fastload error;
    any other exception or a traceback fails the test. Returns {what: "same" | "error"}."""
    from fastload.cli import main

    out = {}
    n = len(ref["x"]) if ref is not None else 0

    def dataset():
        got = fastload.Dataset(d).get_batch(np.arange(n))
        assert ref is None or all(np.array_equal(got[k], ref[k]) for k in ref), "different data"

    def loader():
        got = _batches(d)
        assert ref_batches is None or _same(got, ref_batches), "different batches"

    def cli(*args):
        def run():
            import contextlib

            err, stdout = io.StringIO(), io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
                rc = main(list(args) + [str(d)])
            text = err.getvalue()
            assert rc in (0, 1) and "Traceback" not in text + stdout.getvalue(), (args, rc, text[-500:])
            assert text.count("\n") <= 1 and (rc == 1 or text == ""), text[-500:]  # one line, or DAMAGED lines
            if rc:
                raise FormatError(text or stdout.getvalue())
        return run

    for what, fn in (("dataset", dataset), ("inspect", cli("inspect")), ("inspect-json", cli("inspect", "--json")),
                     ("verify", cli("verify")), ("loader", loader)):
        try:
            fn()
            out[what] = "same"
        except FastloadError:
            out[what] = "error"
        except IndexError as e:  # fewer samples than before: a named out-of-range index
            assert what == "dataset" and "out of range" in str(e), e
            out[what] = "error"
    return out


def test_manifest_fuzzer_opens_identically_or_names_the_problem(tmp_path):
    """Random edits of manifest.json (values of other types, huge integers, deleted keys,
    flipped bytes of the text) through every reader (_every_reader): the dataset either reads
    exactly as before or a fastload error names the problem; never another exception."""
    d = _raw(tmp_path / "ds", n=120, shard_size=1000)
    text = (d / "manifest.json").read_text()
    ref = fastload.Dataset(d).get_batch(np.arange(120))
    ref_batches = _batches(d)
    junk = [None, "", "x", -1, 0, 1, 7, 1.5, True, [], {}, [1], {"a": 1}, 2**31, 2**32, 2**63 - 1, 2**63, 2**64,
            -2**63, 2**70, 1e308, float("inf"), "../x", "shard-00009.arrow", "xxh3_128:" + "0" * 32, [[1]],
            {"kind": "tensor"}, "int64", "image", [4], [2, 2]]

    def paths(node, prefix=""):
        yield prefix
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            yield from paths(v, f"{prefix}.{k}" if prefix else str(k))

    all_paths = [p for p in paths(json.loads(text)) if p]
    rng = np.random.default_rng(2019)
    kinds = {"same": 0, "error": 0}
    big = [2**31, 2**32, 2**48, 2**62, 2**63 - 1, 2**63, 2**64, 2**70]
    for trial in range(240):
        m = json.loads(text)
        if trial % 4 == 3:  # a consistent edit: totals follow the shard's new value, or an optional key goes
            i, v = int(rng.integers(len(m["shards"]))), big[int(rng.integers(len(big)))]
            what = ("num_samples", "bytes", "-total_bytes", "-label", "-metadata")[int(rng.integers(5))]
            if what == "num_samples":
                delta = v - m["shards"][i]["num_samples"]
                m["shards"][i]["num_samples"] = v
                m["num_samples"] += delta
                m["label"]["counts"][0] += delta
            elif what == "bytes":
                m["total_bytes"] += v - m["shards"][i]["bytes"]
                m["shards"][i]["bytes"] = v
            else:
                m.pop(what[1:], None)
            body = json.dumps(m).encode()
        elif trial % 4 == 2:  # flip a byte of the text itself
            raw = bytearray(text.encode())
            raw[int(rng.integers(len(raw)))] ^= 1 << int(rng.integers(8))
            body = bytes(raw)
        else:
            for _ in range(1 + trial % 2):  # one edit, or two
                p = all_paths[int(rng.integers(len(all_paths)))]
                head, _, last = p.rpartition(".")
                target = p if rng.integers(3) else (f"{head}.-{last}" if head else f"-{last}")
                try:
                    _set(m, target, junk[int(rng.integers(len(junk)))])
                except (KeyError, TypeError, IndexError, ValueError):
                    pass  # deleting a list element by name, or a path a first edit removed
            body = json.dumps(m).encode()
        (d / "manifest.json").write_bytes(body)
        out = _every_reader(d, ref, ref_batches)
        assert len(set(out.values())) == 1 or out["dataset"] == "error", (trial, out, body[:300])
        kinds[out["loader"]] += 1
    (d / "manifest.json").write_text(text)
    assert kinds["error"] > 80 and kinds["same"] >= 4  # both outcomes are exercised


HUGE = [  # consistent edits (a shard's value and the totals it enters): int64 and beyond
    ({"shards.0.num_samples": 2**63, "num_samples": 2**63 + 60}, r"json: num_samples must be an integer >= 0 and <= 9,"),
    ({"shards.0.num_samples": 2**63, "num_samples": 60}, r"shards\[0\].num_samples must be an integer >= 0 and <= 9,"),
    ({"shards.0.num_samples": 2**64, "num_samples": 2**64 + 60}, r"json: num_samples must be an integer >= 0 and <= 9,"),
    ({"shards.0.num_samples": 2**62, "num_samples": 2**62 + 60}, r"shards\[0\].num_samples is 4,611,686,"),
    ({"shards.0.bytes": 2**63, "total_bytes": None}, r"shards\[0\].bytes must be an integer >= 1 and <= "),
    ({"shards.0.bytes": 2**49, "total_bytes": None}, r"shards\[0\].bytes must be an integer >= 1 and <= "),
    ({"shards.0.bytes": 2**40, "shards.0.num_samples": 2**40, "num_samples": 2**40 + 60, "-label": None,
      "total_bytes": None}, r"shard-00000\S*arrow holds 60 rows|size"),
    ({"-total_bytes": None}, None),  # optional: inspect computes it
    ({"format_version": 1.0}, "format_version 1.0"),
    ({"label.class_names": ["a", "b", "a"]}, "label.class_names names 'a' twice"),
    ({"label.counts": [2**63, 0, 0]}, "label.counts must be a list of integers >= 0 and <= num_samples"),
]


@pytest.mark.parametrize("edits,message", HUGE)
def test_counts_and_sizes_beyond_int64_are_refused_by_every_reader(tmp_path, edits, message):
    d = _raw(tmp_path / "ds", n=120, shard_size=1000)
    m = _manifest(d)
    for path, value in edits.items():
        if path == "total_bytes":
            value = sum(s["bytes"] for s in m["shards"])  # after the shard edits
        _set(m, path, value)
    (d / "manifest.json").write_text(json.dumps(m))
    if message is None:
        assert set(_every_reader(d).values()) == {"same"}
        from fastload.store.inspect import inspect_text
        assert f"({sum(s['bytes'] for s in m['shards']) / 1000:.1f} KB;" in inspect_text(d)
        return
    with pytest.raises(FastloadError, match=message):
        fastload.Dataset(d).get_batch(np.arange(120)) if "holds" in message else fastload.Dataset(d)
    assert set(_every_reader(d).values()) == {"error"}


def test_the_manifest_agrees_with_each_shards_schema_including_shapes(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[16]"}) as w:
        w.write_batch({"x": np.arange(32, dtype=np.float32).reshape(2, 16)})
    d = tmp_path / "ds"
    m = _manifest(d)
    m["fields"]["x"]["shape"] = [8, 2]  # the same Arrow type (16 floats), another shape
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=r"column 'x' holds float32\[16\], the manifest says float32\[8,2\]"):
        fastload.Dataset(d).get_batch([0])
    with pytest.raises(FormatError, match=r"float32\[8,2\]"):
        _batches(d)  # every shard is mapped and checked when the first epoch starts
    assert any("schema differs" in p and "float32[8,2]" in p for p in fastload.verify(d))


def test_a_huge_or_non_regular_manifest_is_refused(tmp_path):
    d = _raw(tmp_path / "ds")
    (d / "manifest.json").unlink()
    os.mkfifo(d / "manifest.json")
    t0 = time.perf_counter()
    with pytest.raises(FormatError, match="FIFO"):
        fastload.Dataset(d)
    assert time.perf_counter() - t0 < 5
    (d / "manifest.json").unlink()
    (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # nesting deeper than Python recurses
    with pytest.raises(FormatError, match="not readable JSON|not a fastload manifest"):
        fastload.Dataset(d)
    (d / "manifest.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(FormatError, match="not readable JSON"):
        fastload.Dataset(d)


# -- shards that are not files -------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero", "truncated"])
def test_a_non_regular_or_truncated_shard_is_named_not_hung_on(tmp_path, kind):
    d = _raw(tmp_path / "ds")
    f = d / _manifest(d)["shards"][0]["file"]
    data = f.read_bytes()
    f.unlink()
    if kind == "fifo":
        os.mkfifo(f)
    elif kind == "directory":
        f.mkdir()
    elif kind == "dev_zero":
        f.symlink_to("/dev/zero")
    else:
        f.write_bytes(data[: len(data) // 2])
    what = {"fifo": "FIFO", "directory": "directory", "dev_zero": "character device", "truncated": "holds"}[kind]
    with pytest.raises(FormatError, match=f"{f.name}.*{what}|{what}.*{f.name}"):
        fastload.Dataset(d).get_batch([0])
    with pytest.raises(FormatError, match=what):
        _batches(d, verify="off")
    problems = fastload.verify(d)
    assert problems and problems[0].startswith(f.name)


def test_verify_does_not_hash_a_shard_whose_size_is_already_wrong(tmp_path):
    d = _raw(tmp_path / "ds")
    f = d / _manifest(d)["shards"][1]["file"]
    with open(f, "r+b") as fh:
        fh.truncate(1 << 34)  # 16 GiB, sparse: hashing it would read 16 GiB of zeros
    problems = fastload.verify(d)
    assert problems[0] == f"{f.name}: size {1 << 34} bytes, manifest says {_manifest(d)['shards'][1]['bytes']}"
    assert not any("checksum" in p for p in problems)


# -- readers keep the dataset they opened -------------------------------------------------
def test_an_overwrite_never_serves_the_new_rows_under_the_old_manifest(tmp_path):
    d = tmp_path / "ds"
    for policy in ("off", "first-use"):
        shutil.rmtree(d, ignore_errors=True)
        with fastload.ShardWriter(d, {"x": "int64"}, shard_size=200) as w:
            w.write_batch({"x": np.arange(100)})
        old = fastload.Dataset(d, verify=policy)
        assert old.get_batch([0])["x"].tolist() == [0]  # maps shard 0 only
        loader = fastload.Loader(d, batch_size=10, shuffle=False, device="cpu", verify=policy)
        with fastload.ShardWriter(d, {"x": "int64"}, shard_size=200, overwrite=True) as w:
            w.write_batch({"x": np.arange(100) + 1000})
        new_names = {s["file"] for s in _manifest(d)["shards"]}
        assert not new_names & {p.name for p in old.shard_files}  # no name reused
        assert old.get_batch([1])["x"].tolist() == [1]  # a mapped shard: still the old data
        with pytest.raises(MissingFileError, match="replaced .* since it was opened"):
            old.get_batch([99])
        # a Loader built before the overwrite (it maps shards when its first epoch starts)
        with pytest.raises(MissingFileError, match="replaced"):
            next(iter(loader))
        loader.close()
        assert fastload.Dataset(d).get_batch([99])["x"].tolist() == [1099]
        with fastload.ShardWriter(d, {"x": "int64"}, shard_size=200, overwrite=True) as w:  # and again
            w.write_batch({"x": np.arange(100) + 2000})
        assert not {s["file"] for s in _manifest(d)["shards"]} & new_names


def test_ranks_that_opened_different_generations_of_a_dataset_refuse_to_start(tmp_path):
    from _dist import run_ranks
    from fastload.loader.loader import dataset_fingerprint

    dirs = [tmp_path / f"r{r}" for r in range(3)]
    for r, d in enumerate(dirs):  # the same location ("ds") on every rank; rank 1's has other bytes
        _raw(d / "ds", n=120, seed=1 if r == 1 else 0)
    results = run_ranks(3, "dist_jobs:loader_on_own_dataset", {"dirs": [str(d) for d in dirs]})
    fo, fn = (dataset_fingerprint(fastload.Dataset(d / "ds")) for d in dirs[:2])
    assert fo != fn
    for rank, r in enumerate(results):
        assert r["agreed"] == 4  # the same dataset on every rank: no error
        assert r["errors"], f"rank {rank} trained on a dataset other ranks did not open"
        for _when, error in r["errors"]:  # every error names both versions, the ranks and this rank
            assert "different versions of ds" in error and f"this is rank {rank})" in error
            assert f"ranks 0, 2: {fo}; rank 1: {fn}" in error
    # the rank that built its Loader last (rank 2: they take turns) refused at construction,
    # the others at their first epoch
    assert [[when for when, _ in r["errors"]] for r in results] == [["first epoch"]] * 2 + [["construction"]]


def test_a_loader_on_some_ranks_only_waits_for_no_other_rank(tmp_path):
    from _dist import run_ranks

    _raw(tmp_path / "ds", n=120, seed=0)
    results = run_ranks(2, "dist_jobs:loader_on_rank_0_only", {"path": str(tmp_path / "ds")}, timeout=120)
    assert results[0]["batches"] == 15 and results[1]["batches"] == 0  # 120 / 2 ranks / 4


# -- many shards: more than the open-file limit -------------------------------------------
@pytest.mark.slow
def test_more_shards_than_the_open_file_limit(tmp_path):
    d = tmp_path / "ds"
    n = 500
    with fastload.ShardWriter(d, {"x": "int64"}, shard_size=8) as w:  # one sample a shard
        w.write_batch({"x": np.arange(n)})
    script = textwrap.dedent(f"""
        import os, resource, numpy as np, fastload
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        ds = fastload.Dataset({str(d)!r})
        assert ds.num_shards == {n}
        with fastload.Loader(ds, batch_size=100, shuffle=True, device="cpu") as loader:
            seen = np.sort(np.concatenate([b["x"].numpy() for b in loader]))
        assert seen.tolist() == list(range({n})), seen[:10]
        assert ds.get_batch(np.arange({n}))["x"].tolist() == list(range({n}))
        assert fastload.verify({str(d)!r}) == []
        print("fds", len(os.listdir("/proc/self/fd")))
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(p.stdout.split()[-1]) < 100
