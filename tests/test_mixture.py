"""Mixtures: proportions (exact per batch, statistical per epoch), each dataset's own passes,
epochs by size or by one dataset's exhaustion, fields, source/index, exact resume at any
world size (also on real gloo ranks)."""
import numpy as np
import pytest

import fastload
from fastload.errors import FormatError
from fastload.store.mixture import Mixture
from fastload.sampling.mixture import MixtureSampler, batch_counts
from fastload.store import ShardWriter
from _dist import run_ranks
from _resume import check_resume, rows_read

SIZES = {"web": 500, "books": 90, "code": 23}
OFFSET = {"web": 0, "books": 100_000, "code": 200_000}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, n in SIZES.items():
        with ShardWriter(root / name, {"x": "int64", "t": "int32[]", "label": "int64"}, shard_size=2000) as w:
            w.write_batch({"x": np.arange(n) + OFFSET[name], "label": np.arange(n) % 3,
                           "t": [np.full(i % 7, OFFSET[name] + i, np.int32) for i in range(n)]})
        out[name] = fastload.Dataset(root / name)
    return out


def _read(loader, epochs=1):
    src, idx = [], []
    for e in range(epochs):
        loader.set_epoch(e)
        for b in loader:
            src.append(b["source"].numpy())
            idx.append(b["index"].numpy())
            names = list(SIZES)
            assert b["x"].tolist() == [OFFSET[names[s]] + i for s, i in zip(b["source"].tolist(), b["index"].tolist())]
    return src, idx


def test_counts_per_batch_are_floor_or_ceil_and_add_up():
    w = np.array([0.35, 0.3, 0.35])
    c = batch_counts(w, 10, 5000)
    assert (c.sum(axis=1) == 10).all() and (c[:, 1] == 3).all()
    assert set(c[:, 0].tolist()) == {3, 4} and set(c[:, 2].tolist()) == {3, 4}
    assert abs(c[:, 0].sum() - 0.35 * 50_000) <= 3  # long-run proportions hold to a few samples
    c = batch_counts(np.array([0.7, 0.2, 0.1]), 8, 10_000)
    assert np.abs(c.mean(axis=0) - np.array([5.6, 1.6, 0.8])).max() < 1e-3
    assert set(c[:, 0].tolist()) == {5, 6} and set(c[:, 2].tolist()) == {0, 1}


def test_every_batch_holds_the_proportions_exactly(datasets):
    weights = [0.6, 0.3, 0.1]
    with fastload.Loader(list(datasets.values()), mix=weights, epoch_size=3000, batch_size=20, seed=1) as loader:
        src, _ = _read(loader)
    for s in src:
        counts = np.bincount(s, minlength=3)
        assert counts.tolist() in ([12, 6, 2],), counts  # 20 * p is whole: every batch exactly
    with fastload.Loader(list(datasets.values()), mix=[0.55, 0.3, 0.15], epoch_size=3000, batch_size=16) as loader:
        src, _ = _read(loader)
    assert len(src[-1]) == 3000 % 16  # the last batch is short; every full one holds the proportions
    counts = np.array([np.bincount(s, minlength=3) for s in src[:-1]])
    assert set(counts[:, 0].tolist()) <= {8, 9} and set(counts[:, 1].tolist()) <= {4, 5}
    assert set(counts[:, 2].tolist()) <= {2, 3} and (counts.sum(axis=1) == 16).all()
    assert np.abs(counts.sum(axis=0) / (3000 - 8) - [0.55, 0.3, 0.15]).max() < 0.002


def test_per_epoch_totals_are_exact_and_batches_vary_around_them(datasets):
    mix = Mixture(datasets, {"web": 5, "books": 3, "code": 2}, epoch_size=4000, per="epoch")
    with fastload.Loader(mix, batch_size=40, seed=3) as loader:
        src, _ = _read(loader, epochs=2)
    per_epoch = len(src) // 2
    for e in range(2):
        s = np.concatenate(src[e * per_epoch:(e + 1) * per_epoch])
        assert np.bincount(s).tolist() == [2000, 1200, 800]
    counts = np.array([np.bincount(s, minlength=3) for s in src])
    assert len(set(map(tuple, counts.tolist()))) > 5  # batches differ...
    # ...like draws from the proportions: per-batch counts of "web" have the binomial-ish spread
    z = (counts[:, 0].mean() - 20) / (counts[:, 0].std() / np.sqrt(len(counts)))
    assert abs(z) < 4 and 1.5 < counts[:, 0].std() < 4.5


def test_each_dataset_keeps_its_own_passes(datasets):
    with fastload.Loader(datasets, mix=[0.2, 0.4, 0.4], epoch_size=1000, batch_size=10, seed=7) as loader:
        src, idx = _read(loader, epochs=2)
    s, i = np.concatenate(src), np.concatenate(idx)
    for d, n in enumerate(SIZES.values()):
        seq = i[s == d]
        full = len(seq) // n
        passes = [seq[k * n:(k + 1) * n] for k in range(full)]
        assert full >= (0 if d == 0 else 1)  # 400 of web's 500; books and code several passes
        assert all(sorted(p.tolist()) == list(range(n)) for p in passes)  # each pass: all once
        if full >= 2:
            assert passes[0].tolist() != passes[1].tolist()  # reshuffled per pass
        rest = seq[full * n:]
        assert len(set(rest.tolist())) == len(rest)  # a partial pass: no repeat


def test_stop_on_reads_that_dataset_once_per_epoch(datasets):
    with fastload.Loader(datasets, mix=[0.5, 0.3, 0.2], stop_on="books", batch_size=10, seed=2) as loader:
        n_batches = len(loader)
        src, idx = _read(loader, epochs=3)
    per_epoch = len(src) // 3
    assert per_epoch == n_batches
    for e in range(3):
        s = np.concatenate(src[e * per_epoch:(e + 1) * per_epoch])
        i = np.concatenate(idx[e * per_epoch:(e + 1) * per_epoch])
        assert sorted(i[s == 1].tolist()) == list(range(90))  # every book once
        assert s[-1] == 1  # the epoch ends with the last of them


def test_fields_must_agree_or_be_restricted(datasets, tmp_path):
    with ShardWriter(tmp_path / "other", {"x": "int32", "label": "int64"}) as w:
        w.write_batch({"x": np.arange(5, dtype=np.int32), "label": np.zeros(5, np.int64)})
    other = fastload.Dataset(tmp_path / "other")
    with pytest.raises(FormatError, match=r"differ in field\(s\).*pass fields=\[...\] with fields they share: \['label'\]"):
        fastload.Loader([datasets["web"], other], mix=[1, 1], epoch_size=10, batch_size=2)
    with pytest.raises(FormatError, match="field 'x' differs between the mixture's datasets"):
        fastload.Loader([datasets["web"], other], mix=[1, 1], epoch_size=10, batch_size=2, fields=["x"])
    with fastload.Loader([datasets["web"], other], mix=[1, 1], epoch_size=10, batch_size=2, fields=["label"]) as lo:
        assert sorted(next(iter(lo))) == ["index", "label", "source"]


@pytest.mark.parametrize("kw, err", [
    ({"mix": [1, 2]}, "mixes several datasets"),
    ({"dataset": "list"}, "a list of datasets is a mixture: pass mix="),
    ({"dataset": "list", "mix": [1, 2, 3], "epoch_size": 5, "stop_on": "web"}, "epoch_size=N .* or stop_on=NAME"),
    ({"dataset": "list", "mix": [1, 2]}, "one entry per dataset"),
    ({"dataset": "list", "mix": [1, 0, 1], "epoch_size": 5}, "must be finite and > 0"),
    ({"dataset": "list", "mix": [1, 1, 1], "stop_on": "nope"}, "stop_on='nope' must name one of"),
    ({"dataset": "list", "mix": [1, 1, 1], "epoch_size": 5, "balance": True}, "balance= does not apply to a mixture"),
])
def test_bad_mixture_arguments(datasets, kw, err):
    kw = dict(kw)
    ds = list(datasets.values()) if kw.pop("dataset", None) == "list" else datasets["web"]
    with pytest.raises(ValueError, match=err):
        fastload.Loader(ds, batch_size=4, **kw)


def _make(datasets, per="batch", **kw):
    def make(rank=0, world_size=1, **extra):
        mix = Mixture(datasets, [0.5, 0.3, 0.2], epoch_size=333, per=per)
        return fastload.Loader(mix, batch_size=8, seed=11, rank=rank, world_size=world_size, **kw, **extra)
    return make


@pytest.mark.parametrize("per", ["batch", "epoch"])
def test_resume_equals_the_uninterrupted_run_at_every_batch(datasets, per):
    full = check_resume(_make(datasets, per=per), epochs=2)
    assert len(full) == 2 * 42 and "source" in full[0]


def test_resume_packed_mixture(datasets):
    check_resume(lambda **kw: fastload.Loader(datasets, mix=[2, 1, 1], epoch_size=300, batch_size=2, pack_to=8,
                                              fields=["t"], seed=5, **kw), epochs=2, stops=[0, 1, 3, 7, 20, 40])


def test_resume_at_another_world_size_reads_every_position_once(datasets):
    make = _make(datasets, drop_last=False)
    mixture = Mixture(datasets, [0.5, 0.3, 0.2], epoch_size=333)
    sampler = MixtureSampler(mixture, batch_size=8, seed=11)
    stream = sampler.stream(0)
    full, _ = rows_read(make, 1, key="x")
    head, state = rows_read(make, 3, stop_after=5, key="x")
    tail, _ = rows_read(make, 2, state=state, key="x")
    starts = np.array([OFFSET[n] for n in SIZES])
    want = mixture.reader.split(stream)
    want = starts[want[0]] + want[1]
    assert np.array_equal(full, want)
    got = np.concatenate([head, tail])
    assert np.array_equal(got[:333], want)  # then the wrap-around padding of the last step
    assert np.array_equal(got[333:], want[:len(got) - 333])


def test_mixture_resume_on_real_ranks(datasets):
    paths = {n: str(d.path) for n, d in datasets.items()}
    first = run_ranks(3, "dist_jobs:mixture_epoch", {"paths": paths, "stop_after": 4})
    state = first[0]["state"]
    rest = run_ranks(2, "dist_jobs:mixture_epoch", {"paths": paths, "state": state})
    with _make(datasets)() as loader:
        want = np.concatenate([b["x"].numpy() for b in loader])
    got = np.array(first[0]["read"] + rest[0]["read"])
    assert np.array_equal(got[:len(want)], want)


def _batches_by_rank(make, world_size, state=None):
    """Every rank's batches of epoch 0 (from ``state`` when given): [[source array per batch] per rank]."""
    out = []
    for r in range(world_size):
        with make(rank=r, world_size=world_size) as loader:
            if state is not None:
                loader.load_state_dict(state)
            loader.set_epoch(0)
            out.append([b["source"].numpy().copy() for b in loader])
    return out


@pytest.mark.parametrize("weights", [[0.6, 0.3, 0.1], [0.55, 0.3, 0.15]])
def test_per_batch_counts_are_exact_on_every_rank_and_after_a_resume_at_another_world_size(datasets, weights):
    """per="batch": one rank's batch is one run of batch_size stream positions, whatever the
    world size, so its counts are exactly that run's (floor or ceil of B * p, rotating): at
    2 and 3 ranks, and on 2 ranks resuming a state 3 ranks saved after 5 steps."""
    B, M = 20, 3000  # M is a whole number of batches at 1, 2 and 3 ranks: every batch is full
    want = batch_counts(np.array(weights) / sum(weights), B, M // B)

    def make(rank=0, world_size=1):
        return fastload.Loader(list(datasets.values()), mix=weights, epoch_size=M, batch_size=B, seed=1,
                               rank=rank, world_size=world_size)

    for world_size in (1, 2, 3):
        per_rank = _batches_by_rank(make, world_size)
        assert all(len(p) == M // B // world_size for p in per_rank)
        for r, batches in enumerate(per_rank):
            for k, s in enumerate(batches):
                chunk = k * world_size + r  # the run of B positions this batch is
                assert np.bincount(s, minlength=3).tolist() == want[chunk].tolist(), (world_size, r, k)
    with make(rank=0, world_size=3) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
        it.close()
    assert state["sampler"]["consumed"] == 5 * 3 * B
    per_rank = _batches_by_rank(make, 2, state)
    left = M // B - 15  # runs of B positions left: 135, so 67 steps of two runs and a last one
    assert [[len(s) for s in p] for p in per_rank] == [[B] * (left // 2) + [B // 2]] * 2
    for r, batches in enumerate(per_rank):
        for k, s in enumerate(batches[:-1]):
            chunk = 15 + k * 2 + r
            assert np.bincount(s, minlength=3).tolist() == want[chunk].tolist(), (r, k)
    # the last run is split between the ranks (equal counts per rank, like DistributedSampler):
    # together their last batches hold it exactly
    last = np.concatenate([per_rank[0][-1], per_rank[1][-1]])
    assert np.bincount(last, minlength=3).tolist() == want[-1].tolist()
    if weights == [0.6, 0.3, 0.1]:
        assert (want == [12, 6, 2]).all()


def test_pack_to_mixes_documents_and_weights_over_mean_lengths_give_token_shares(tmp_path):
    """With pack_to a mixture's proportions are of documents: dataset i gets tokens in
    proportion to p_i times its mean length; dividing the weights by the mean lengths (the
    README's recipe) gives proportions of tokens."""
    rng = np.random.default_rng(0)
    ds = {}
    for name, (lo, hi) in {"short": (2, 7), "long": (18, 23)}.items():
        with ShardWriter(tmp_path / name, {"t": "int32[]"}) as w:
            w.write_batch({"t": [np.zeros(k, np.int32) for k in rng.integers(lo, hi, 400)]})
        ds[name] = fastload.Dataset(tmp_path / name)
    means = np.array([ds[n].lengths("t").mean() for n in ds])

    def token_shares(weights):
        tokens = np.zeros(2)
        with fastload.Loader(ds, mix=list(weights), epoch_size=4000, batch_size=4, pack_to=16, seed=3) as loader:
            for b in loader:
                off = b["t_offsets"].numpy()
                np.add.at(tokens, b["source"].numpy(), off[1:] - off[:-1])
        return tokens / tokens.sum()

    got = token_shares([0.5, 0.5])
    want = 0.5 * means / (0.5 * means).sum()
    assert np.abs(got - want).max() < 0.02 and got[1] > 0.75  # documents half and half, tokens not
    assert np.abs(token_shares(np.array([0.5, 0.5]) / means) - 0.5).max() < 0.02


def test_the_next_epochs_mixture_stream_is_prepared_ahead_and_equal(datasets, monkeypatch):
    """A mixture's stream is computed per position: nothing is prepared in the background
    for the Loader's own batches; once a whole stream is asked for (a remote cache's plan),
    the next epoch's is prepared ahead, equal to the stream computed when asked for."""
    from fastload.sampling import sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "PREPARE_MIN_NS", 0)  # (a small order is otherwise computed when asked for)
    kw = dict(mix=[0.6, 0.3, 0.1], epoch_size=600, batch_size=20, seed=3)
    with fastload.Loader(list(datasets.values()), **kw) as loader:
        first = _read(loader, epochs=1)
        assert loader.sampler._ahead is None  # per position: no epoch's array to prepare
        loader.sampler.stream(0)  # a whole stream asked for: the next ones are prepared ahead
        loader.set_epoch(1)
        for b in loader:
            first[0].append(b["source"].numpy())
            first[1].append(b["index"].numpy())
        ahead = loader.sampler._ahead
        assert ahead is not None and ahead.epoch == 2  # the epoch after the last one read
    with fastload.Loader(list(datasets.values()), **kw) as fresh:
        fresh.sampler.prepare = lambda epoch: None  # nothing prepared: every stream computed when asked
        again = _read(fresh, epochs=2)
        assert np.array_equal(ahead.wait(), fresh.sampler.stream(2))  # the mixture's order, not a permutation
    assert len(first[0]) == len(again[0])
    assert all(np.array_equal(a, b) for a, b in zip(first[1], again[1]))
    assert all(np.array_equal(a, b) for a, b in zip(first[0], again[0]))
