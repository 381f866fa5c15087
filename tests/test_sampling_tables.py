"""The tables of weighted and class-balanced draws kept once per node (issue 30): built in
chunks (equal to the whole-array construction), kept in the cache directory keyed by the
content of the weights / labels, built by one process of the node and memory-mapped by all,
a damaged file built again, concurrent builders safe, and a rank's memory bounded at 10^8."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fastload import Sampler
from fastload.runtime import kept as kept_mod
from fastload.runtime.kept import Flock
from fastload.sampling import tables
from fastload.sampling.order import Weighted

ROOT = Path(__file__).resolve().parent.parent


# -- the chunked builds equal the whole-array ones ------------------------------------------
def _whole_weight_table(w):
    """The construction before issue 30's per-node tables: whole arrays, one pass each."""
    cdf = np.cumsum(w, dtype=np.float64)
    n, total = len(cdf), float(cdf[-1])
    c = (cdf * (n / total)).astype(np.int64)
    np.clip(c, 0, n, out=c)
    guide = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(c, minlength=n + 1)[:n], out=guide[1:])
    guide[n] = n
    return cdf, guide


def _whole_balance_table(labels):
    _, inverse = np.unique(labels, return_inverse=True)
    inverse = inverse.ravel()
    members = np.argsort(inverse, kind="stable")
    starts = np.zeros(int(inverse.max()) + 2, np.int64)
    np.cumsum(np.bincount(inverse), out=starts[1:])
    return members, starts


def _weight_cases():
    rng = np.random.default_rng(0)
    heavy = rng.pareto(0.5, 5000)  # a few weights span many guide slices: the search path
    heavy[::3] = 0
    return [heavy, rng.random(4000).astype(np.float32), np.arange(3000) % 10 + 1,
            np.r_[np.zeros(100), 1.0, np.zeros(1000), 1e-300, 5.0, np.zeros(7)],  # 1e-300 is absorbed by the sum
            np.r_[1e9, np.ones(2000)], np.r_[np.ones(2000), 1e9], np.array([0.0, 2.0]), np.array([3.0])]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_chunked_weight_table_equals_the_whole_array_one(monkeypatch, chunk):
    monkeypatch.setattr(tables, "CHUNK", chunk)
    for w in _weight_cases():
        cdf, guide, last = tables.weight_table(w)
        want_cdf, want_guide = _whole_weight_table(w)
        assert cdf.tobytes() == want_cdf.tobytes()  # every sum added as np.cumsum adds it
        assert np.array_equal(guide, want_guide) and guide.dtype == np.int32
        assert w[last] > 0 and cdf[last] == cdf[-1] and (last == 0 or cdf[last - 1] < cdf[-1])


@pytest.mark.parametrize("chunk", [1, 5, 333, 1 << 20])
def test_chunked_balance_table_equals_the_whole_array_one(monkeypatch, chunk):
    monkeypatch.setattr(tables, "CHUNK", chunk)
    rng = np.random.default_rng(1)
    cases = [rng.choice(4, size=3000, p=[0.85, 0.1, 0.04, 0.01]), rng.integers(-5, 70_000, 2000),  # wide: searched
             rng.integers(0, 3, 1000).astype(np.uint8), rng.choice(np.array(["cat", "dog", "x"]), 1500),
             rng.choice([0.5, -2.0, 7.25], 999), np.array([True, False, True]), np.full(10, 9)]
    for labels in cases:
        members, starts = tables.balance_table(labels)
        want_m, want_s = _whole_balance_table(labels)
        assert np.array_equal(members, want_m) and np.array_equal(starts, want_s), labels.dtype


# -- kept once per node ---------------------------------------------------------------------
@pytest.fixture
def kept(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tables, "MAP_MIN", 100)
    return tmp_path / "cache" / "tables"


def _folders(root: Path, fmt: str) -> list[Path]:
    return sorted(p for p in (root / fmt).iterdir()) if (root / fmt).exists() else []


def test_weight_table_is_kept_mapped_and_draws_the_same(kept, monkeypatch):
    w = np.random.default_rng(2).pareto(1.0, 5000)
    w[::7] = 0
    cdf, guide, last = tables.weight_table(w)
    assert isinstance(cdf, np.memmap) and isinstance(guide, np.memmap) and not cdf.flags.writeable
    (folder,) = _folders(kept, tables.WEIGHTED_FORMAT)
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "cdf.npy", "guide.npy"]  # no temporary left
    monkeypatch.setattr(tables, "MAP_MIN", 10**9)
    mem = tables.weight_table(w)  # the same table in memory
    assert not isinstance(mem[0], np.memmap)
    assert np.array_equal(cdf, mem[0]) and np.array_equal(guide, mem[1]) and last == mem[2]
    pos = np.arange(0, 10**9, 997)
    assert np.array_equal(Weighted((cdf, guide, last), 10**9, 3, 1).at(pos), Weighted(mem, 10**9, 3, 1).at(pos))
    # a second process of the node (a copy of the weights: keyed by content, not identity)
    # maps the file and builds nothing
    monkeypatch.setattr(tables, "MAP_MIN", 100)
    monkeypatch.setattr(tables, "fill_weight_table", lambda *a: pytest.fail("built again"))
    again = tables.weight_table(w.copy())
    assert isinstance(again[0], np.memmap) and os.path.samefile(again[0].filename, cdf.filename)
    # other weights: another table
    monkeypatch.undo()
    monkeypatch.setenv("FASTLOAD_CACHE", str(kept.parent))
    monkeypatch.setattr(tables, "MAP_MIN", 100)
    w2 = w.copy()
    w2[17] += 1
    tables.weight_table(w2)
    assert len(_folders(kept, tables.WEIGHTED_FORMAT)) == 2


def test_sampler_draws_equal_with_a_kept_table_and_an_in_memory_one(kept, monkeypatch):
    rng = np.random.default_rng(3)
    w, labels = rng.random(4000), rng.choice(5, 4000, p=[0.6, 0.2, 0.1, 0.07, 0.03])
    kw = dict(batch_size=32, world_size=3, rank=1, seed=9, num_draws=100_000)
    kept_w, kept_b = Sampler(4000, weights=w, **kw), Sampler(4000, balance_labels=labels, **kw)
    kept_w.set_epoch(2)
    kept_b.set_epoch(2)
    got_w, got_b = [np.concatenate(list(s)) for s in (kept_w, kept_b)]
    assert isinstance(kept_w._table[0], np.memmap) and isinstance(kept_b._table[0], np.memmap)
    monkeypatch.setattr(tables, "MAP_MIN", 10**9)
    mem_w, mem_b = Sampler(4000, weights=w, **kw), Sampler(4000, balance_labels=labels, **kw)
    mem_w.set_epoch(2)
    mem_b.set_epoch(2)
    assert np.array_equal(got_w, np.concatenate(list(mem_w))) and np.array_equal(got_b, np.concatenate(list(mem_b)))
    assert not isinstance(mem_w._table[0], np.memmap)
    assert sorted(np.bincount(labels[got_b[:32]], minlength=5).tolist()) == [6, 6, 6, 7, 7]  # balanced indeed


@pytest.mark.parametrize("damage", ["truncate", "pad", "header", "wrong-shape", "bad-values"])
def test_a_damaged_table_is_built_again(kept, caplog, damage):
    w = np.arange(1, 3001, dtype=float)
    cdf, guide, _ = tables.weight_table(w)
    want_cdf, want_guide = np.array(cdf), np.array(guide)
    folder = Path(cdf.filename).parent
    del cdf, guide
    path = folder / ("guide.npy" if damage != "bad-values" else "cdf.npy")
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:len(raw) - 100])
    elif damage == "pad":
        path.write_bytes(raw + b"\0" * 64)
    elif damage == "header":
        path.write_bytes(b"not an npy file" + raw[15:])
    elif damage == "wrong-shape":
        np.save(path, np.zeros(7, np.int32))
    else:
        np.save(path, -np.ones(3000))  # the right shape, values no table holds
    with caplog.at_level(logging.WARNING, logger="fastload"):
        cdf, guide, _ = tables.weight_table(w)
    assert "does not hold a table of 3,000 weights; building it again" in caplog.text
    assert np.array_equal(cdf, want_cdf) and np.array_equal(guide, want_guide)
    assert isinstance(cdf, np.memmap) and os.path.getsize(path) == len(raw)


def test_a_damaged_class_table_is_built_again(kept, caplog):
    labels = np.arange(2000) % 3
    members, starts = tables.balance_table(labels)
    folder = Path(members.filename).parent
    want = np.array(members)
    del members, starts
    np.save(folder / "starts.npy", np.array([0, 5, 9]))  # does not end at the sample count
    with caplog.at_level(logging.WARNING, logger="fastload"):
        members, starts = tables.balance_table(labels)
    assert "does not hold a class table of 2,000 labels" in caplog.text
    assert np.array_equal(members, want) and starts.tolist() == [0, 667, 1334, 2000]


def test_a_builder_that_waited_too_long_builds_too_and_nothing_breaks(kept, monkeypatch, caplog):
    """A process holding the lock (stopped, say) past the wait: this one builds the table
    itself; its renames replace equal files, and a map of the earlier file stays valid."""
    w = np.random.default_rng(4).random(3000)
    first = tables.weight_table(w)
    folder = Path(first[0].filename).parent
    inode = os.stat(folder / "cdf.npy").st_ino
    (folder / "guide.npy").unlink()  # (so the table is built again)
    holder = Flock(folder / ".lock")
    assert holder.try_lock()
    monkeypatch.setattr(kept_mod, "build_wait_s", lambda n: 0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="fastload"):
            second = tables.weight_table(w)
    finally:
        holder.close()
    assert "has been building the weighted-draw table of 3,000 weights" in caplog.text
    assert os.stat(folder / "cdf.npy").st_ino != inode  # replaced by this process's equal file
    assert np.array_equal(first[0], second[0]) and np.array_equal(first[1], second[1])  # the old map still reads


def test_without_a_cache_directory_the_table_is_held_in_memory(tmp_path, monkeypatch, caplog):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "afile"))
    monkeypatch.setattr(tables, "MAP_MIN", 100)
    labels = np.arange(500) % 4
    with caplog.at_level(logging.WARNING, logger="fastload"):
        members, starts = tables.balance_table(labels)
    assert not isinstance(members, np.memmap) and starts.tolist() == [0, 125, 250, 375, 500]
    assert "could not keep the class table of 500 labels" in caplog.text and "FASTLOAD_CACHE" in caplog.text


def test_labels_of_python_objects_are_held_in_memory(kept):
    labels = np.array([("a", 1), ("b", 2)] * 100, dtype=object)[:, 0]
    members, starts = tables.balance_table(labels)
    assert not isinstance(members, np.memmap) and starts.tolist() == [0, 100, 200]
    assert not (kept / tables.BALANCED_FORMAT).exists()


# -- two processes of one node --------------------------------------------------------------
_RANK = textwrap.dedent("""
    import json, logging, os, sys, time
    import numpy as np
    from fastload.sampling import tables
    from fastload.sampling.order import Balanced, Weighted
    kind, go = sys.argv[1], sys.argv[2]
    built = []
    class H(logging.Handler):
        def emit(self, r):
            if r.getMessage().startswith("fastload: built "):
                built.append(r.getMessage())
    log = logging.getLogger("fastload"); log.addHandler(H()); log.setLevel(logging.INFO)
    fill = tables.fill_weight_table if kind == "weighted" else tables.fill_balance_table
    def slow(*a):  # the build takes a while: the other rank arrives while it runs
        time.sleep(0.5)
        return fill(*a)
    setattr(tables, fill.__name__, slow)
    n = 1 << 20
    rng = np.random.default_rng(5)
    data = rng.random(n) if kind == "weighted" else rng.integers(0, 10, n)
    while not os.path.exists(go):
        time.sleep(0.001)
    t = tables.weight_table(data) if kind == "weighted" else tables.balance_table(data)
    path = os.path.realpath(t[0].filename)
    inode = os.stat(path).st_ino
    mapped = [line.split() for line in open("/proc/self/maps") if line.rstrip().endswith(path)]
    pos = np.arange(0, 10**9, 99991)
    s = Weighted(t, 10**9, 1, 0) if kind == "weighted" else Balanced(t, 10**9, 40, 1, 0)
    print(json.dumps({"built": len(built), "inode": inode, "maps_inodes": sorted({int(m[4]) for m in mapped}),
                      "path": path, "draws": s.at(pos).tolist()}))
""")


@pytest.mark.parametrize("kind", ["weighted", "balanced"])
def test_two_ranks_of_a_node_build_the_table_once_and_both_map_it(tmp_path, kind):
    env = dict(os.environ, FASTLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, kind, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    go.touch()  # both start at once
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(o["built"] for o in outs) == 1  # one build per node
    final = os.stat(outs[0]["path"]).st_ino
    for o in outs:  # both map the one file that is there
        assert o["path"] == outs[0]["path"] and o["inode"] == final and o["maps_inodes"] == [final]
    assert outs[0]["draws"] == outs[1]["draws"]
    folder = Path(outs[0]["path"]).parent
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


# -- memory per rank at 10^8 ----------------------------------------------------------------
_BIG = textwrap.dedent("""
    import json, sys, time, tracemalloc
    import numpy as np
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    w = np.load(sys.argv[1], mmap_mode="r")  # the user's weights, memory-mapped
    from fastload import Sampler
    next(iter(Sampler(10, batch_size=2, weights=np.ones(10))))  # imports and numpy's first calls
    a0 = anon()
    tracemalloc.start()
    t0 = time.perf_counter()
    s = Sampler(len(w), batch_size=256, world_size=1024, rank=int(sys.argv[2]), weights=w, num_draws=10**10)
    first = next(iter(s))
    t = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"first_s": t, "peak": peak, "anon_growth": anon() - a0, "first": first[:8].tolist(),
                      "mapped": type(s._table[0]).__name__}))
""")


@pytest.mark.slow
def test_memory_per_rank_is_bounded_at_a_hundred_million_weights(tmp_path):
    n = 10**8
    wpath = tmp_path / "w.npy"
    w = np.lib.format.open_memmap(wpath, mode="w+", dtype=np.float64, shape=(n,))
    for a in range(0, n, 1 << 24):
        b = min(n, a + (1 << 24))
        w[a:b] = (np.arange(a, b) % 1000 + 1) / 7
    w.flush()
    del w
    env = dict(os.environ, FASTLOAD_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    runs = []
    for rank in (0, 0, 5):  # the builder, then two ranks that map its table
        out = subprocess.run([sys.executable, "-c", _BIG, str(wpath), str(rank)], env=env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for r in runs:
        assert r["mapped"] == "memmap"
        # the builder: a few chunks of 2^20 samples (~40 MB), never the table (1.2 GB) nor the
        # weights (0.8 GB)
        assert r["peak"] < 100 << 20, r
        assert r["anon_growth"] < 100 << 20, r
    for r in runs[1:]:  # a rank mapping the node's table: a few MB
        assert r["peak"] < 64 << 20 and r["anon_growth"] < 64 << 20, r
    assert runs[0]["first"] == runs[1]["first"]


# -- weighted draws without replacement: an array per epoch, its limit said -------------------
def test_draws_without_replacement_past_memory_are_refused_and_large_ones_warned(monkeypatch, caplog):
    from fastload.runtime import system
    from fastload.sampling import sampler as sampler_mod

    w = np.ones(1000)
    monkeypatch.setattr(system, "available_memory", lambda: 15_000)  # 20 bytes per sample and 8 per draw: 28,000 needed
    with pytest.raises(ValueError, match=r"num_draws=1,000 weighted draws without replacement over 1,000 samples "
                                         r"\(each epoch's order is computed whole, on every rank.* needs 28.0 KB of "
                                         r"memory, but only 15.0 KB is available; use replacement=True"):
        Sampler(1000, batch_size=10, weights=w, replacement=False)
    Sampler(1000, batch_size=10, weights=w)  # with replacement: per position, nothing per draw to hold
    monkeypatch.setattr(system, "available_memory", lambda: None)
    monkeypatch.setattr(sampler_mod, "DRAWN_WARN", 500)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        s = Sampler(1000, batch_size=10, weights=w, replacement=False, num_draws=600)
    assert "each epoch costs every rank about" in caplog.text and "use replacement=True" in caplog.text
    assert len(np.unique(s.stream(0))) == 600


# -- a Loader's weights= / balance= field: its values kept per node too ---------------------
def _mapped(a) -> bool:
    """True when ``a`` is a view of a memory-mapped file (np.asarray drops np.memmap's class)."""
    import mmap

    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = getattr(a, "base", None)
    return False


def test_a_loaders_weight_and_label_fields_are_kept_per_node_and_draw_the_same(tmp_path, monkeypatch):
    import fastload
    from fastload.store import lengths as lengths_mod

    n = 3000
    with fastload.ShardWriter(tmp_path / "ds", {"label": "int64", "w": "float32"}, label="label",
                              shard_size="4KB") as wr:
        wr.write_batch({"label": np.arange(n) % 7, "w": (np.arange(n) % 3 + 1).astype(np.float32)})
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))

    def epoch(**kw):
        with fastload.Loader(tmp_path / "ds", batch_size=70, seed=4, fields=["label", "w"], device="cpu", **kw) as lo:
            kept = lo.sampler.weights if "weights" in kw else lo.sampler.labels
            table = lo.sampler.order_stream()
            out = np.concatenate([b["label"].numpy() * 10 + b["w"].numpy().astype(np.int64) for b in lo])
            return out, kept, table

    small = [epoch(weights="w"), epoch(balance=True)]
    assert not _mapped(small[0][1]) and not _mapped(small[1][1])
    monkeypatch.setattr(lengths_mod, "MAP_MIN", 100)
    monkeypatch.setattr(tables, "MAP_MIN", 100)
    big = [epoch(weights="w"), epoch(balance=True)]
    for (got, values, _stream), (want, mem, _) in zip(big, small):
        assert _mapped(values) and not values.flags.writeable  # the field's values: a view of the kept file
        assert np.array_equal(values, mem) and values.dtype == mem.dtype
        assert np.array_equal(got, want)  # the same draws
    assert isinstance(big[0][2].cdf, np.memmap) and isinstance(big[1][2].members, np.memmap)  # the tables: mapped
    kept = sorted(p.name for p in (tmp_path / "cache" / "lengths").rglob("*.npy"))
    assert kept == ["values-label.npy", "values-w.npy"]


def test_a_large_arrays_identity_is_hashed_fast_and_still_tells_arrays_apart(monkeypatch):
    from fastload.sampling import state

    monkeypatch.setattr(state, "FAST_DIGEST_MIN", 100)
    w = np.arange(1, 1001, dtype=np.float32)
    a = Sampler(1000, batch_size=10, weights=w, seed=1)
    next(iter(a))
    saved = a.state_dict()
    assert saved["weights"].startswith("x") and len(saved["weights"]) == 16  # xxh3, not blake2b
    b = Sampler(1000, batch_size=10, weights=w.astype(np.float64), seed=1)  # the same values: the same identity
    b.load_state_dict(saved)
    assert np.array_equal(next(iter(b)), a.stream(0)[10:20])
    w2 = w.copy()
    w2[5] += 1
    with pytest.raises(ValueError, match="saved with weights="):
        Sampler(1000, batch_size=10, weights=w2, seed=1).load_state_dict(saved)
    labels = np.arange(1000) % 3
    c = Sampler(1000, batch_size=9, balance_labels=labels, seed=1)
    with pytest.raises(ValueError, match="saved with balance_labels="):
        Sampler(1000, batch_size=9, balance_labels=(labels + 1) % 3, seed=1).load_state_dict(c.state_dict())


# -- the sampler's weights / labels are its own: an in-place change of the caller's array ----
@pytest.mark.parametrize("large", [False, True])
@pytest.mark.parametrize("replacement", [True, False])
def test_changing_the_callers_weights_after_construction_changes_nothing(kept, monkeypatch, large, replacement):
    """The draws (with and without replacement), the kept table and the state's digest all come
    from the weights as they were at construction: a small array is copied, a large one copied
    once into a file kept per node."""
    if not large:
        monkeypatch.setattr(tables, "MAP_MIN", 10**9)
    kw = dict(batch_size=10, replacement=replacement, num_draws=500, seed=3)
    w = np.ones(2000)
    s = Sampler(2000, weights=w, **kw)
    assert s.weights is not w and not s.weights.flags.writeable
    first = np.concatenate(list(s))
    saved = s.state_dict()
    w[:1000] = 0.0  # the caller reuses its buffer
    s.set_epoch(1)
    got = np.concatenate(list(s))
    assert s.state_dict()["weights"] == saved["weights"]
    ref = Sampler(2000, weights=np.ones(2000), **kw)
    ref.set_epoch(1)
    assert np.array_equal(got, np.concatenate(list(ref))) and (got < 1000).any()
    ref.load_state_dict(saved)  # the same identity as a sampler of the original weights
    assert np.array_equal(first, np.concatenate(list(Sampler(2000, weights=np.ones(2000), **kw))))
    copies = _folders(kept, tables.COPY_FORMAT)
    assert len(copies) == (1 if large else 0)
    if large:
        assert _mapped(s.weights) and np.array_equal(np.load(copies[0] / "values.npy"), np.ones(2000))


def test_labels_are_the_samplers_own_too(kept, monkeypatch):
    labels = np.arange(3000) % 3
    s = Sampler(3000, batch_size=30, balance_labels=labels, seed=1)
    labels[:] = 0  # one class only, were it read now
    b = np.concatenate(list(s))
    assert np.bincount(np.arange(3000)[b] % 3).tolist() == [1000, 1000, 1000]
    assert len(_folders(kept, tables.COPY_FORMAT)) == 1


def test_an_array_nothing_can_change_is_used_where_it_lies(kept, tmp_path):
    """A read-only memory map (a fastload kept file, np.load(mmap_mode='r')) is not copied."""
    np.save(tmp_path / "w.npy", np.arange(1, 2001, dtype=np.float32))
    w = np.load(tmp_path / "w.npy", mmap_mode="r")
    s = Sampler(2000, batch_size=10, weights=w, seed=0)
    assert tables.frozen(s.weights) and np.shares_memory(s.weights, w)
    assert not _folders(kept, tables.COPY_FORMAT)
    view = np.ones(2000)
    ro = view[:]
    ro.flags.writeable = False  # a read-only view of a writable array: still changeable, so copied
    assert not tables.frozen(ro) and Sampler(2000, batch_size=10, weights=ro).weights is not ro


def test_bool_weights_draw_only_the_true_samples(tmp_path, monkeypatch):
    import fastload

    keep = np.arange(100) % 2 == 0
    for replacement in (True, False):
        s = Sampler(100, batch_size=10, weights=keep, replacement=replacement, seed=0)
        assert set(np.concatenate(list(s)) % 2) == {0}
    with fastload.ShardWriter(tmp_path / "ds", {"x": "int64", "keep": "bool"}) as wr:
        wr.write_batch({"x": np.arange(100), "keep": keep})
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    with fastload.Loader(tmp_path / "ds", batch_size=10, weights="keep", device="cpu") as lo:
        got = np.concatenate([b["x"].numpy() for b in lo])
    assert len(got) == 100 and set(got % 2) == {0}
    with pytest.raises(ValueError, match="real numbers"):
        Sampler(3, batch_size=1, weights=np.array(["a", "b", "c"]))
