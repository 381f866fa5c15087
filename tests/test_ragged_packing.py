"""Sequence packing (pack_to=N): the per-batch piece bound when a batch is longer than the
epoch's token stream, the epoch's pieces computed at once against the per-batch definition,
and pack_to with weighted and window sampling (balance= is refused)."""
import numpy as np
import pytest

import fastload
from fastload.sampling.packing import max_pieces, pack_bounds, pieces
from fastload.store import ShardWriter
from test_ragged_loader import pack_reference


def _write(path, docs, **extra):
    fields = {"tokens": "int32[]", **{k: "int64" for k in extra}}
    with ShardWriter(path, fields, shard_size=300) as w:
        w.write_batch({"tokens": docs, **extra})
    return fastload.Dataset(path)


def _check_rows(ds, make, world_size, stream, rows, n, drop_last=False):
    want = pack_reference(ds, stream, rows, n, world_size=world_size, drop_last=drop_last)
    for r in range(world_size):
        with make(rank=r, world_size=world_size) as loader:
            got = list(loader)
        mine = want[r::world_size]
        assert len(got) == len(mine) > 0
        for g, w in zip(got, mine):
            for k, v in w.items():
                assert g[k].numpy().tolist() == v.tolist(), (r, k)


@pytest.mark.parametrize("world_size", [1, 3])
def test_pack_to_longer_than_the_whole_corpus(tmp_path, world_size):
    """One rank's batch (2 rows of 32 tokens) is longer than the epoch's 15 tokens: the
    stream wraps around several times inside one batch (drop_last=False), each document
    piece a row of its own in the other keys."""
    docs = [np.arange(5, dtype=np.int32) + 10 * i for i in range(3)] + [np.zeros(0, np.int32)]
    ds = _write(tmp_path / "ds", docs)
    stream = fastload.Sampler(len(ds), batch_size=2, seed=4).stream(0)

    def make(**kw):
        return fastload.Loader(ds, batch_size=2, pack_to=32, seed=4, **kw)

    _check_rows(ds, make, world_size, stream, 2, 32)
    with make() as loader:
        b = next(iter(loader))
    assert len(b["index"]) == 14 and b["tokens_offsets"].tolist()[-1] == 64  # 2 row cuts + 12 documents


def test_the_piece_bound_holds_in_any_order_and_the_epoch_pieces_equal_each_batch_s(tmp_path):
    from fastload.sampling.packing import epoch_pieces

    rng = np.random.default_rng(7)
    for trial in range(400):
        lens = rng.integers(0, rng.integers(1, 40), rng.integers(1, 14))
        rows, length = int(rng.integers(1, 4)), int(rng.integers(1, 50))
        world, drop = int(rng.integers(1, 4)), bool(rng.integers(0, 2))
        bound = max_pieces(lens, rows, length)
        for _ in range(3):  # the bound is for any order of the documents
            order = rng.permutation(lens)
            cum = np.concatenate([[0], np.cumsum(order)]).astype(np.int64)
            for rank in range(world):
                bounds = pack_bounds(int(rng.integers(0, max(int(cum[-1]), 1))), int(cum[-1]), world, rank, rows,
                                     length, drop)
                begins = np.array([b for b, _, _ in bounds], np.int64)
                ends = np.array([e for _, e, _ in bounds], np.int64)
                docs, first, count, at = epoch_pieces(cum, begins, ends, length)
                for k, (b, e, _) in enumerate(bounds):
                    want = pieces(cum, b, e, length)
                    got = (docs[at[k]:at[k + 1]], first[at[k]:at[k + 1]], count[at[k]:at[k + 1]])
                    assert all(np.array_equal(x, y) for x, y in zip(got, want)), (trial, k)
                    assert len(want[0]) <= bound, (trial, order.tolist(), rows, length)
                    assert count[at[k]:at[k + 1]].sum() == e - b


def test_pack_to_with_weights_reads_the_weighted_stream(tmp_path):
    rng = np.random.default_rng(3)
    docs = [np.arange(k, dtype=np.int32) + 1000 * i for i, k in enumerate(rng.integers(0, 30, 60))]
    w = np.where(np.arange(60) % 4 == 0, 0.0, 1.0 + np.arange(60) % 3)  # every 4th document never drawn
    ds = _write(tmp_path / "ds", docs, w=(w * 10).astype(np.int64))
    for kw in ({"weights": w}, {"weights": w, "replacement": False, "num_draws": 30}, {"weights": "w"}):
        def make(kw=kw, **extra):
            return fastload.Loader(ds, batch_size=3, pack_to=16, seed=8, fields=["tokens"], **kw, **extra)

        with make() as loader:
            stream = loader.sampler.stream(0)
        assert not np.isin(stream, np.flatnonzero(w == 0)).any()
        if "num_draws" in kw:
            assert len(stream) == 30 and len(set(stream.tolist())) == 30
        _check_rows(ds, make, 2, stream, 3, 16)


def test_pack_to_with_window_shuffle(tmp_path):
    rng = np.random.default_rng(5)
    docs = [np.arange(k, dtype=np.int32) + 1000 * i for i, k in enumerate(rng.integers(1, 40, 80))]
    ds = _write(tmp_path / "ds", docs)
    assert ds.num_shards >= 6

    def make(**extra):
        return fastload.Loader(ds, batch_size=2, pack_to=24, seed=2, shuffle_mode="window", window=2, **extra)

    with make() as loader:
        stream = loader.sampler.stream(0)
    shard_of = np.searchsorted(np.cumsum(ds.shard_sizes), stream, side="right")
    assert len(np.unique(shard_of[:len(stream) // 3])) < ds.num_shards  # shards come a window at a time
    assert sorted(stream.tolist()) == list(range(len(ds)))
    _check_rows(ds, make, 1, stream, 2, 24)
    _check_rows(ds, make, 2, stream, 2, 24, drop_last=False)


def test_balance_with_pack_to_is_refused(tmp_path):
    ds = _write(tmp_path / "ds", [np.arange(3, dtype=np.int32)] * 6, label=np.arange(6) % 2)
    with pytest.raises(ValueError, match="balance=True makes class-balanced batches.*use weights="):
        fastload.Loader(ds, batch_size=2, pack_to=8, balance=True, fields=["tokens"])
    with pytest.raises(ValueError, match="balance='label'"):
        fastload.Loader(ds, batch_size=2, pack_to=8, balance="label", fields=["tokens"])


def test_a_batch_with_more_pieces_than_the_ring_holds_is_named_in_user_terms(tmp_path, monkeypatch):
    """Should the bound ever be short, the error names pack_to, batch_size, the epoch and
    the field (never the ring's internal row count as if the user had passed it)."""
    from fastload.loader import machinery

    ds = _write(tmp_path / "ds", [np.arange(3, dtype=np.int32)] * 12)
    monkeypatch.setattr(machinery, "max_pieces", lambda *a, **k: 2)
    with fastload.Loader(ds, batch_size=2, pack_to=8, seed=0) as loader:
        with pytest.raises(RuntimeError, match=r"pack_to=8 with batch_size=2: a batch of epoch 0 holds \d+ pieces "
                                               r"of documents of 'tokens', more than the 2 .*a bug in fastload"):
            iter(loader)
