"""What a Loader needs from all the lengths of a ragged field (issue 30): one pass in chunks,
never a copy of all N lengths, kept beside lengths memory-mapped from the node's cache so a
later Loader reads none of them; each number equals the whole-array computation (or bounds
it, past the histogram and the kept longest)."""
import time

import numpy as np
import pytest

import fastload
from fastload.loader import ragged
from fastload.sampling import length_summary as ls
from fastload.sampling import packing
from fastload.sampling.packing import max_pieces, token_total
from fastload.store import ShardWriter
from fastload.store import lengths as lengths_mod


def _pieces_formula(lengths, rows, length, max_length=None):
    tok = lengths if max_length is None else np.minimum(lengths, max_length)
    nz = np.sort(tok[tok > 0])
    if nz.sum() == 0:
        return max(1, rows)
    passes, rest = divmod(rows * length, int(nz.sum()))
    whole = passes * len(nz) + int(np.searchsorted(np.cumsum(nz), rest, side="right"))
    return min(rows * length, rows + whole + 1)


def test_each_number_equals_the_whole_array_or_bounds_it_past_the_histogram(monkeypatch):
    """Small chunks, histogram and kept-longest sizes, so lengths cross all three."""
    monkeypatch.setattr(ls, "STEP", 7)
    monkeypatch.setattr(ls, "HIST", 16)
    monkeypatch.setattr(ls, "TOP", 5)
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 60))
        lengths = rng.integers(0, int(rng.choice([3, 15, 40])), n) * (rng.random(n) < 0.8)
        max_length = None if trial % 3 else int(rng.integers(1, 30))
        tok = lengths if max_length is None else np.minimum(lengths, max_length)
        s = ls.compute(lengths, max_length)
        assert (s.n, s.total, s.nonzero) == (n, int(tok.sum()), int(np.count_nonzero(tok)))
        assert s.longest == int(tok.max(initial=0)) and s.mean == (tok.mean() if n else 0.0)
        for k in range(0, n + 3):
            want = int(np.sort(tok)[::-1][:k].sum()) + max(0, k - n) * int(tok.max(initial=0))
            got = s.longest_sum(k)
            assert got == want if k <= 5 else got >= want, (trial, k)
        for rows, length in ((1, 1), (2, 7), (3, 20), (1, 200)):
            want = _pieces_formula(lengths, rows, length, max_length)
            got = s.most_pieces(rows, length)
            if (tok >= 16).any() and rows * length >= 16:  # past the histogram: a bound
                assert want <= got <= rows * length, (trial, rows, length)
            else:
                assert got == want, (trial, rows, length)


def test_a_negative_length_is_named():
    with pytest.raises(ValueError, match="length -2 of sample 3 is negative"):
        ls.compute(np.array([1, 2, 0, -2]))


class _ReadInChunks:
    """Lengths that say how they are read: never whole (``__array__`` fails), at most
    ``most`` at a time."""

    def __init__(self, v, most):
        self.v, self.most, self.largest = v, most, 0
        self.flags = v.flags

    def __len__(self):
        return len(self.v)

    def __getitem__(self, key):
        out = self.v[key]
        self.largest = max(self.largest, np.size(out))
        assert np.size(out) <= self.most, f"read {np.size(out)} lengths at once"
        return out

    def __array__(self, *a, **k):
        raise AssertionError("the lengths were read whole")


def _dataset(path, n=900):
    docs = [np.arange((i * 7) % 23, dtype=np.int32) for i in range(n)]
    with ShardWriter(path, {"tokens": "int32[]"}, shard_size=2000) as w:
        w.write_batch({"tokens": docs})
    return fastload.Dataset(path)


@pytest.mark.parametrize("kw", [dict(ragged="padded", max_length=9), dict(ragged="packed", max_length=9),
                                dict(ragged="packed"), dict(pack_to=16)])
def test_a_loader_reads_the_lengths_in_chunks_never_whole(tmp_path, monkeypatch, kw):
    """Before, the padded/packed modes np.minimum-ed and np.partition-ed all N lengths (two
    copies per Loader); the batches are the same either way."""
    ds = _dataset(tmp_path / "ds")
    with fastload.Loader(ds, batch_size=8, seed=3, device="cpu", **kw) as lo:
        want = [{k: v.clone() for k, v in b.items()} for b in lo]
    fresh = fastload.Dataset(tmp_path / "ds")
    kept = fresh.lengths("tokens")
    chunky = _ReadInChunks(kept, most=50)
    monkeypatch.setattr(type(fresh), "lengths", lambda self, field: chunky)
    monkeypatch.setattr(ls, "STEP", 50)
    monkeypatch.setattr(packing, "CHUNK", 50)  # a packed pass reads its stream's lengths in chunks too
    with fastload.Loader(fresh, batch_size=8, seed=3, device="cpu", **kw) as lo:
        got = list(lo)
    assert chunky.largest > 0 and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


@pytest.fixture
def cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(lengths_mod, "MAP_MIN", 10)  # memory-mapped from the cache past 10 samples
    _dataset(tmp_path / "ds")
    return tmp_path / "ds"


@pytest.mark.parametrize("kw", [dict(ragged="padded", max_length=9), dict(ragged="packed"), dict(pack_to=16)])
def test_a_later_loader_of_the_node_reads_the_summary_not_the_lengths(cached, monkeypatch, kw):
    with fastload.Loader(fastload.Dataset(cached), batch_size=8, seed=3, device="cpu", **kw) as lo:
        want = [b["index"].tolist() for b in lo]
    v = fastload.Dataset(cached).lengths("tokens")
    ml = kw.get("max_length")
    kept, _ = ls.summary_path(v, ml)
    assert kept.exists() and kept.parent == ls.Path(v.filename).parent
    monkeypatch.setattr(ls, "compute", lambda *a, **k: pytest.fail("the lengths were summarised again"))
    with fastload.Loader(fastload.Dataset(cached), batch_size=8, seed=3, device="cpu", **kw) as lo:
        assert [b["index"].tolist() for b in lo] == want


def test_a_summary_of_other_lengths_or_a_damaged_one_is_made_again(cached):
    v = fastload.Dataset(cached).lengths("tokens")
    want = int(np.asarray(v).sum())
    assert token_total(v) == want
    kept, source = ls.summary_path(v, None)
    assert kept.exists()
    with np.load(kept) as a:
        arrays = {k: a[k] for k in a.files}
    arrays["head"][3] += 1  # a wrong total, made from a file of another size
    arrays["source"][0] += 8
    np.savez(kept, **arrays)
    again = fastload.Dataset(cached).lengths("tokens")
    assert token_total(again) == want  # not the file's: it summarised other lengths
    with np.load(kept) as a:
        assert tuple(a["source"]) == source and int(a["head"][3]) == want  # written again
    kept.write_bytes(b"not a summary")
    third = fastload.Dataset(cached).lengths("tokens")
    assert token_total(third) == want and max_pieces(third, 2, 16) == _pieces_formula(np.asarray(v), 2, 16)


def test_only_whole_read_only_maps_of_fastloads_lengths_files_are_summarised_on_disk(cached, tmp_path):
    v = fastload.Dataset(cached).lengths("tokens")
    assert ls.summary_path(v, None) is not None
    assert ls.summary_path(v[5:], None) is None  # a slice of the file: not its summary
    assert ls.summary_path(np.asarray(v).copy(), None) is None
    np.save(tmp_path / "mine.npy", np.arange(20))
    assert ls.summary_path(np.load(tmp_path / "mine.npy", mmap_mode="r"), None) is None  # the user's file
    assert ls.summary_path(np.load(v.filename, mmap_mode="r+"), None) is None  # writable


def test_the_ring_is_sized_from_the_summary(tmp_path):
    ds = _dataset(tmp_path / "ds")
    lens = np.asarray(ds.lengths("tokens"))
    for mode, ml in (("padded", None), ("padded", 9), ("packed", None), ("packed", 9)):
        d = ragged.RaggedDelivery(mode, max_length=ml)
        tok = lens if ml is None else np.minimum(lens, ml)
        f = ragged.ring_field(ds, "tokens", d, 8)
        want = 8 * int(tok.max()) if mode == "padded" else int(np.sort(tok)[-8:].sum())
        assert f.capacity == min(want, max(ragged.RAGGED_SLOT_BUDGET // 4, 2 * 8 * int(np.ceil(tok.mean()))))


def test_a_packed_mixture_reads_the_lengths_in_chunks_never_whole(tmp_path, monkeypatch):
    """Before, a mixture's epoch token count took each dataset's lengths whole (a copy)."""
    from fastload.sampling import mixture
    from fastload.store.concat import ConcatReader

    ds = {"a": _dataset(tmp_path / "a", 300), "b": _dataset(tmp_path / "b", 200)}

    def run():
        with fastload.Loader(ds, mix=[2, 1], epoch_size=400, batch_size=2, pack_to=16, seed=5, device="cpu") as lo:
            return [{k: v.clone() for k, v in b.items()} for b in lo]
    want = run()
    real = ConcatReader.lengths
    wrapped = {}

    def chunky(self, field):
        if field not in wrapped:
            wrapped[field] = _ReadInChunks(real(self, field), most=50)
        return wrapped[field]
    monkeypatch.setattr(ConcatReader, "lengths", chunky)
    for mod in (packing, mixture):
        monkeypatch.setattr(mod, "CHUNK", 3)  # mixture: slices of CHUNK * 16
    monkeypatch.setattr(ls, "STEP", 50)
    got = run()
    assert wrapped["tokens"].largest > 0 and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def _plans(lengths, stream, start, total):
    return packing.pack_plan(0, start, stream, lengths, rows=2, length=16, world_size=2, rank=1, drop_last=False,
                             total=total)


def _requests(plan):
    return [(r.index.tolist(), r.start.tolist(), r.count.tolist(), r.positions.tolist(), after)
            for r, after in plan.requests()]


def test_a_resume_reads_the_lengths_from_the_nodes_chunk_counts_on(cached, monkeypatch):
    """A pass over an epoch keeps its chunk counts beside the lengths; a later pass resumed
    near the end of that epoch reads only the chunks holding its tokens, and its batches
    equal those of a pass that reads every length before them."""
    from fastload.sampling.order import Shuffled, Weighted
    from fastload.sampling.tables import weight_table

    monkeypatch.setattr(packing, "CHUNK", 7)
    monkeypatch.setattr(packing, "KEEP_NEW", 1)
    v = fastload.Dataset(cached).lengths("tokens")
    n, total = len(v), token_total(v)
    stream = Shuffled(n, seed=4, epoch=2)
    path = packing.chunk_index_path(stream, v, None)
    assert path is not None and not path.exists()
    assert _requests(_plans(v, stream, 0, total))  # the whole epoch: its counts kept
    assert path.exists() and len(np.load(path)) == -(-n // 7) + 1
    start = total - 5 * 2 * 2 * 16 + 3
    read = []
    real = packing.TokenStream._tokens
    monkeypatch.setattr(packing.TokenStream, "_tokens", lambda self, j: read.append(j) or real(self, j))
    resumed = _requests(_plans(v, stream, start, total))
    near = (n * (start - 400) // total) // 7 - 3  # (the last step wraps around to the first chunk)
    assert len(set(read)) <= 8 and all(j == 0 or j >= near for j in read) and max(read) >= near, read
    monkeypatch.setattr(packing, "chunk_index_path", lambda *a: None)  # every length read again
    read.clear()
    assert resumed == _requests(_plans(v, stream, start, total)) and min(read) == 0
    monkeypatch.undo()
    # another epoch, draws by weights, a slice of the lengths: not the same counts, or not kept
    assert packing.chunk_index_path(Shuffled(n, seed=4, epoch=3), v, None) != path
    assert packing.chunk_index_path(stream, v, 9) != path
    assert packing.chunk_index_path(Weighted(weight_table(np.ones(n)), n, 1, 0), v, None) is None
    assert packing.chunk_index_path(stream, v[1:], None) is None


def test_chunk_counts_that_cannot_be_this_streams_are_not_used(cached, monkeypatch):
    from fastload.sampling.order import Shuffled

    monkeypatch.setattr(packing, "CHUNK", 7)
    v = fastload.Dataset(cached).lengths("tokens")
    n, total = len(v), token_total(v)
    stream = Shuffled(n, seed=1, epoch=0)
    want = _requests(_plans(v, stream, 100, total))
    path = packing.chunk_index_path(stream, v, None)
    chunks = -(-n // 7)
    for bad in (np.arange(chunks + 1, dtype=np.int64)[::-1].copy(),  # decreasing
                np.arange(chunks + 2, dtype=np.int64),  # too long
                np.arange(chunks + 1, dtype=np.int64) * 10**9,  # past the total
                np.zeros(3, np.int32)):  # another dtype
        np.save(path, bad)
        assert _requests(_plans(v, stream, 100, total)) == want
    path.write_bytes(b"not an index")
    assert _requests(_plans(v, stream, 100, total)) == want


# -- a lengths file replaced while a process holds the old map (review-b, item 1) ----------
def _replaced(tmp_path, n, old_value, new_value):
    """A ``lengths-text.npy`` mapped, then replaced (a new inode, as a rebuild after a damaged
    copy was removed): the old map and a map of the new file."""
    from fastload.files import atomic_write

    p = tmp_path / "lengths-text.npy"
    np.save(p, np.full(n, old_value, np.int64))
    old = np.load(p, mmap_mode="r")
    atomic_write(p, lambda f: np.save(f, np.full(n, new_value, np.int64)), fsync=False)
    return p, old


def _kept(folder, what):
    return sorted(f.name for f in folder.iterdir() if f".{what}-" in f.name)


def test_a_stale_map_keeps_no_summary_under_the_new_files_identity(tmp_path):
    """Before, a process still holding the old map wrote the old lengths' summary labelled
    with the new file's identity, and every later Loader sized its ring from it."""
    p, old = _replaced(tmp_path, 1000, 7, 500)
    s = ls.length_summary(old)
    assert (s.longest, s.total) == (7, 7000)  # the numbers of the array it was asked about
    assert _kept(tmp_path, "summary") == []  # but not kept: the path holds other lengths now
    new = np.load(p, mmap_mode="r")
    s = ls.length_summary(new)
    assert (s.longest, s.total, s.longest_sum(8)) == (500, 500_000, 4000)
    assert _kept(tmp_path, "summary") == ["lengths-text.summary-all.npz"]
    # a summary labelled with this file's identity but made from other lengths (the old
    # code's leftover, or a file changed within the clock's tick): its fingerprint differs
    kept, source = ls.summary_path(new, None)
    ls._write(kept, source[:-1] + (ls.fingerprint(old),), ls.compute(old))
    again = np.load(p, mmap_mode="r")
    assert ls.length_summary(again).longest == 500 and max_pieces(again, 8, 512) == _pieces_formula(
        np.asarray(again), 8, 512)


def test_a_summary_is_not_written_when_the_file_changed_while_it_was_computed(tmp_path, monkeypatch):
    from fastload.files import atomic_write

    p = tmp_path / "lengths-text.npy"
    np.save(p, np.arange(100, dtype=np.int64))
    v = np.load(p, mmap_mode="r")
    real = ls.compute

    def computing(*a, **k):
        out = real(*a, **k)
        atomic_write(p, lambda f: np.save(f, np.arange(100, dtype=np.int64) * 3), fsync=False)
        return out
    monkeypatch.setattr(ls, "compute", computing)
    assert ls.length_summary(v).total == 4950
    assert _kept(tmp_path, "summary") == []


def test_a_stale_map_keeps_no_chunk_counts_and_a_fresh_one_does_not_read_them(tmp_path, monkeypatch):
    """Before, the old map's counts were kept under the new file's identity and a later pass
    over the new file took its epoch's token total (150x too large here) from them."""
    from fastload.sampling.order import Shuffled

    monkeypatch.setattr(packing, "CHUNK", 64)
    p, old = _replaced(tmp_path, 640, 300, 2)
    stream = Shuffled(640, seed=0, epoch=0)
    assert packing.TokenStream(stream, old).total == 640 * 300
    assert packing.chunk_index_path(stream, old, None) is None and _kept(tmp_path, "chunks") == []
    new = np.load(p, mmap_mode="r")
    assert packing.TokenStream(stream, new).total == 640 * 2
    assert len(_kept(tmp_path, "chunks")) == 1
    assert max_pieces(new, 8, 512) == _pieces_formula(np.asarray(new), 8, 512)
    # replaced while a pass reads it: its counts are not written (the path holds others)
    t = packing.TokenStream(Shuffled(640, seed=0, epoch=1), new)
    from fastload.files import atomic_write
    atomic_write(p, lambda f: np.save(f, np.full(640, 5, np.int64)), fsync=False)
    assert t.total == 640 * 2 and len(_kept(tmp_path, "chunks")) == 1


# -- chunk-count files are swept (review-b, item 2) ----------------------------------------
def test_chunk_count_files_of_other_identities_old_epochs_and_killed_writes_are_removed(tmp_path, monkeypatch):
    import os
    import time

    from fastload.sampling.order import Shuffled

    monkeypatch.setattr(packing, "CHUNK", 64)
    p = tmp_path / "lengths-text.npy"
    np.save(p, np.arange(640, dtype=np.int64) % 50)
    v = np.load(p, mmap_mode="r")
    planted = {"lengths-text.chunks-0123456789ab-0123456789abcdef0123.npy": True,  # another identity
               "lengths-text.chunks-0123456789abcdef0123456789abcdef.npy": True,  # the older naming
               ".lengths-text.chunks-0123456789ab-0123.npy.77.88.tmp": True,  # a killed write, long ago
               ".lengths-text.chunks-0123456789ab-4567.npy.77.99.tmp": False,  # a write going on
               "lengths-other.chunks-0123456789ab-0123456789abcdef0123.npy": False,  # another field's
               "lengths-text.npy.chunks-note.txt": False}  # not one of fastload's names
    for name in planted:
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - 2 * packing.TEMP_AGE
    os.utime(tmp_path / ".lengths-text.chunks-0123456789ab-0123.npy.77.88.tmp", (long_ago, long_ago))
    made = []
    for epoch in range(6):
        t = packing.TokenStream(Shuffled(640, seed=0, epoch=epoch), v)
        assert t.total == int((np.arange(640) % 50).sum())
        made.append(packing.chunk_index_path(t.stream, v, None).name)
        os.utime(tmp_path / made[-1], (time.time() - 100 + epoch, time.time() - 100 + epoch))  # (distinct mtimes)
    left = set(os.listdir(tmp_path))
    assert [m in left for m in made] == [False, False, True, True, True, True]  # the latest 4 epochs
    assert {name for name, gone in planted.items() if name in left} == {n for n, g in planted.items() if not g}
    # a resumed pass over an epoch whose counts were swept reads the lengths again: same total
    assert packing.TokenStream(Shuffled(640, seed=0, epoch=0), v).total == int((np.arange(640) % 50).sum())


# -- a mixture's whole passes are counted once (review-b, item 3) --------------------------
def test_a_mixtures_whole_dataset_passes_are_counted_once_not_every_epoch():
    from fastload.sampling.mixture import MixtureLayout, MixtureStream

    class Counting:
        def __init__(self, a):
            self.a, self.by_slice = a, 0

        def __len__(self):
            return len(self.a)

        def __getitem__(self, i):
            if isinstance(i, slice):
                self.by_slice += len(range(*i.indices(len(self.a))))
            return self.a[i]

    sizes, starts = np.array([3000, 2000]), np.array([0, 3000])
    lens = np.random.default_rng(0).integers(0, 50, 5000).astype(np.int64)
    c = Counting(lens)
    layout = MixtureLayout(np.array([0.5, 0.5]), sizes, batch_size=8, per="sample", seed=0, epoch_size=4000,
                           stop_on=None)
    read = []
    for e in range(4):
        for ml in (None, 20):
            s = MixtureStream(layout, sizes, starts, 0, e, True)
            before = c.by_slice
            got = s.token_total(c, ml)
            read.append(c.by_slice - before)
            tok = lens[np.asarray(s[0:len(s)])]
            assert got == int((tok if ml is None else np.minimum(tok, ml)).sum())
    assert read[:2] == [5000, 5000] and read[2:] == [0] * 6, read  # each max_length's once


@pytest.mark.parametrize("dtype", ["<i8", ">i8", "<i4", "<u2"])
@pytest.mark.parametrize("n", [0, 1, 5000])
def test_the_fingerprint_read_from_the_file_equals_the_arrays(tmp_path, dtype, n):
    """kept_file compares the fingerprint of the array with that of the file at its path
    (read with pread): the same lengths must give the same fingerprint in any dtype."""
    p = tmp_path / "lengths-text.npy"
    np.save(p, (np.arange(n) * 7 % 1000).astype(dtype))
    v = np.load(p, mmap_mode="r")
    kept = ls.kept_file(v)
    assert kept is not None and kept[1][-1] == ls.fingerprint(v) == ls.fingerprint(np.asarray(v, np.int64))


def test_ranks_starting_together_compute_the_summary_once_and_read_it(tmp_path, monkeypatch):
    """The node's ranks start together: before, each found no summary and passed over all the
    lengths (2-6 s at 10^8). One takes the lock beside the file (a kernel flock: each process
    or thread its own open file) and computes it; the others wait, then read what it wrote."""
    import threading

    p = tmp_path / "lengths-text.npy"
    np.save(p, np.arange(5000, dtype=np.int64) % 97)
    real, calls = ls.compute, []

    def slow(*a, **k):  # long enough that every other rank asks while it computes
        calls.append(threading.get_ident())
        time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(ls, "compute", slow)
    ranks = 6
    start, got, errors = threading.Barrier(ranks), [None] * ranks, []

    def rank(i):
        try:
            v = np.load(p, mmap_mode="r")  # each rank its own map of the node's file
            start.wait()
            got[i] = ls.length_summary(v, 50)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and all(s is not None for s in got)
    assert len(calls) == 1  # one rank computed it
    want = real(np.arange(5000, dtype=np.int64) % 97, 50)
    assert all((s.total, s.longest, s.n) == (want.total, want.longest, want.n) for s in got)
    assert _kept(tmp_path, "summary") == ["lengths-text.summary-50.npz"]
    assert ls.summary_lock(p).exists()  # (the lock file stays: deleting it races with the next locker)


def test_ranks_whose_summary_cannot_be_written_compute_it_side_by_side(tmp_path, monkeypatch):
    """When the rank holding the lock cannot write the summary (a full disk), the ranks that
    waited find nothing: each computes it without the lock, at the same time (not one after
    the other, N times the time), and every one gets the right summary."""
    import threading

    p = tmp_path / "lengths-text.npy"
    np.save(p, np.arange(5000, dtype=np.int64) % 97)
    real, spans = ls.compute, []

    def slow(*a, **k):
        t0 = time.monotonic()
        time.sleep(0.5)
        out = real(*a, **k)
        spans.append((t0, time.monotonic()))
        return out

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ls, "compute", slow)
    monkeypatch.setattr(ls, "atomic_write", full_disk)  # (_write logs it and goes on)
    ranks = 4
    start, got, errors = threading.Barrier(ranks), [None] * ranks, []

    def rank(i):
        try:
            v = np.load(p, mmap_mode="r")
            start.wait()
            got[i] = ls.length_summary(v, 50)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = real(np.arange(5000, dtype=np.int64) % 97, 50)
    assert not errors and all((s.total, s.longest, s.n) == (want.total, want.longest, want.n) for s in got)
    assert len(spans) == ranks
    first_end = min(e for _, e in spans)
    # the waiters started computing while or right after the holder computed, together: with the
    # lock held through each computation they would start 0.5 s apart (the last 1.5 s after)
    assert max(b for b, _ in spans) < first_end + 0.4, spans
