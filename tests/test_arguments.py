"""Bad arguments and impossible sizes: a clear error naming the argument, before anything is
allocated; never a silent truncation (1.7 -> 1), a bool taken for an int, an aliased seed, a
segfault or std::bad_alloc (issue 19, "Manifest and arguments" and "Hangs and crashes")."""
import json

import numpy as np
import pytest

import fastload
from fastload import vision
from fastload.errors import ConvertError

N = 100


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("args") / "ds"
    with fastload.ShardWriter(d, {"x": "float32[8]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.arange(N * 8, dtype=np.float32).reshape(N, 8), "label": np.arange(N) % 4})
    return d


LOADER_BAD = [
    (dict(world_size=1.5, rank=0), "world_size=1.5 must be an int"),
    (dict(world_size=2, rank=1.7), "rank=1.7 must be an int"),
    (dict(world_size=2, rank=True), "rank=True must be an int"),
    (dict(world_size=True, rank=0), "world_size=True must be an int"),
    (dict(world_size=2, rank=2), r"rank=2 must be an int in \[0, world_size=2\)"),
    (dict(seed=1.5), "seed=1.5 must be an int"),
    (dict(seed=True), "seed=True must be an int"),
    (dict(seed=None), "seed=None must be an int"),
    (dict(seed=-1), "seed=-1 must be an int"),
    (dict(seed=2**64), r"seed=18446744073709551616 must be an int in \[0, 18446744073709551615\]"),
    (dict(threads=1.5), "threads=1.5 must be an int"),
    (dict(threads=0), "threads=0 must be an int"),
    (dict(prefetch=1.5), "prefetch=1.5 must be an int"),
    (dict(prefetch=True), "prefetch=True must be an int"),
    (dict(prefetch=0), "prefetch=0 must be an int"),
    (dict(batch_size=True), "batch_size=True must be an int"),
    (dict(batch_size=8.0), "batch_size=8.0 must be an int"),
    (dict(batch_size=0), "batch_size=0 must be an int"),
    (dict(shuffle="no"), "shuffle='no' must be True or False"),
    (dict(drop_last=1), "drop_last=1 must be True or False"),
    (dict(replacement="yes", weights=np.ones(N)), "replacement='yes' must be True or False"),
    (dict(balance=1), "balance=1 must be True or False"),
    (dict(num_draws=1.5, weights=np.ones(N)), "num_draws=1.5 must be an int"),
    (dict(window=2.5, shuffle_mode="window"), "window=2.5 must be an int"),
    (dict(log_every=True), "log_every=True must be an int"),
    (dict(on_error="ignore"), "on_error='ignore' must be one of"),
    (dict(verify="sometimes"), "verify='sometimes' must be one of"),
    (dict(verify=True), "verify=True must be one of"),
    # (draws without replacement are an array per epoch; with replacement they are computed
    # per position and any num_draws fits: tests/test_sampling_draws_scale.py)
    (dict(num_draws=10**12, weights=np.ones(N), replacement=False),
     r"num_draws=1,000,000,000,000 .* needs .* of memory"),
    (dict(fields=["x", "x", "label"]), r"fields: \['x'\] named more than once"),
]


@pytest.mark.parametrize("kwargs,message", LOADER_BAD, ids=[str(k) for k, _ in LOADER_BAD])
def test_the_bad_argument_table(ds_path, kwargs, message):
    kw = dict(batch_size=10, device="cpu")
    kw.update(kwargs)
    with pytest.raises(ValueError, match=message):
        fastload.Loader(ds_path, **kw)


@pytest.mark.parametrize("kwargs,message", [
    (dict(seed=2**64), "seed="), (dict(seed=True), "seed=True"), (dict(rank=1.0, world_size=2), "rank=1.0"),
    (dict(shuffle=None), "shuffle=None"), (dict(num_samples=True), "num_samples=True"),
])
def test_the_sampler_takes_the_same_checks(kwargs, message):
    kw = dict(num_samples=N, batch_size=10)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=message):
        fastload.Sampler(**kw)


def test_seeds_at_the_top_of_the_range_do_not_alias():
    a = fastload.Sampler(N, batch_size=N, seed=2**64 - 1)
    b = fastload.Sampler(N, batch_size=N, seed=2**63 - 1)
    assert not np.array_equal(next(iter(a)), next(iter(b)))


def test_vision_and_dataset_arguments(ds_path):
    for make in (lambda: vision.custom(lambda e, device: e, shape=(3, 8, 8), max_pixels=-1),
                 lambda: vision.train(32, max_pixels=0), lambda: vision.eval(32, max_pixels=1.5),
                 lambda: vision.train(32, max_pixels=True)):
        with pytest.raises(ValueError, match="max_pixels=.* must be an int"):
            make()
    build = lambda e, device: e  # noqa: E731
    for shape, message in (((3, 2.9, 8), r"shape\[1\]=2.9 must be an int"),
                           ((True, 8, 8), r"shape\[0\]=True must be an int"),
                           ((3, 0, 8), r"shape\[1\]=0 must be an int > 0"),
                           ((3, "8", 8), r"shape\[1\]='8' must be an int"),
                           ((), "must be a non-empty sequence"), (8, "must be a non-empty sequence"),
                           ("388", "must be a non-empty sequence")):
        with pytest.raises(ValueError, match=message):
            vision.custom(build, shape=shape)
    assert vision.custom(build, shape=np.array([3, 8, 8])).out_shape == (3, 8, 8)
    ds = fastload.Dataset(ds_path)
    for bad in ([1.7], [True, False], np.array([0.0, 1.0]), ["3"]):
        with pytest.raises(ValueError, match="indices must be integers"):
            ds.get_batch(bad)
    assert ds.get_batch(np.array([3], np.uint8))["label"].tolist() == [3]
    with pytest.raises(TypeError, match="must be an int, not bool"):
        ds[True]
    with pytest.raises(TypeError, match="must be an int, not float"):
        ds[1.0]
    with pytest.raises(ValueError, match="verify='yes' must be one of"):
        fastload.Dataset(ds_path, verify="yes")
    with pytest.raises(ValueError, match="opened with verify='first-use'"):
        fastload.Loader(ds, batch_size=4, verify="off")


def test_a_state_consumed_far_beyond_the_epoch_is_refused(ds_path):
    loader = fastload.Loader(ds_path, batch_size=10, device="cpu", world_size=3, rank=0)
    state = loader.state_dict()
    state["sampler"]["consumed"] = 10**9
    with pytest.raises(ValueError, match="consumed=1000000000, beyond the end of an epoch of 100"):
        loader.load_state_dict(state)
    state["sampler"]["consumed"] = 102  # the padded end at world size 3 (34 per rank): still fine
    loader.load_state_dict(state)
    assert len(loader) == 0
    state["sampler"]["consumed"] = 103
    with pytest.raises(ValueError, match="beyond the end"):
        loader.load_state_dict(state)
    state["sampler"]["consumed"] = 1.5
    with pytest.raises(ValueError, match=r"state\['consumed'\]=1.5 must be an int"):
        loader.load_state_dict(state)
    loader.close()


# -- sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [2**62, 10**7, N + 1])
def test_a_batch_size_beyond_the_dataset_makes_slots_of_what_the_dataset_can_fill(ds_path, batch_size):
    with fastload.Loader(ds_path, batch_size=batch_size, shuffle=False, device="cpu", prefetch=10**7) as loader:
        batches = list(loader)
        assert [len(b["label"]) for b in batches] == [N]
        assert loader.options.slot_rows == N and loader.options.slots == 3  # one batch an epoch
        assert loader.stats()["ring"]["slot_bytes"] < 1 << 20
    with fastload.Loader(ds_path, batch_size=batch_size, shuffle=False, device="cpu", world_size=4, rank=3) as ld:
        assert ld.options.slot_rows == 25 and [len(b["label"]) for b in ld] == [25]


def test_slots_that_do_not_fit_in_memory_are_refused_before_allocating(ds_path, monkeypatch):
    import fastload.runtime.system
    monkeypatch.setattr(fastload.runtime.system, "available_memory", lambda: 8 << 10)
    with pytest.raises(ValueError, match=r"batch_size=50 \(50 rows per batch on this rank\) with prefetch=2 .* "
                                         r"needs .* of memory, but only .* is available; lower batch_size or prefetch"):
        fastload.Loader(ds_path, batch_size=50, prefetch=2, device="cpu")
    from fastload.ring.ring import Ring
    with pytest.raises(ValueError, match="lower batch_size or the number of slots"):
        Ring({"x": (np.float32, (1024,))}, 1000, slots=4)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="batch_size=4611686018427387904 rows"):
        Ring({"x": (np.float32, (1024,))}, 2**62, slots=4)


def test_shard_sizes_are_whole_byte_counts(tmp_path):
    for bad, message in ((1.5, "shard_size=1.5 is not a size"), (1e6, "shard_size=1000000.0 is not a size"),
                         (True, "shard_size=True is not a size"), ("1.5", "'1.5' is not a whole number of bytes"),
                         (0, "must be between 1 byte and 2 GiB"), ("3GiB", "must be between 1 byte and 2 GiB")):
        with pytest.raises(ValueError, match=message):
            fastload.ShardWriter(tmp_path / "w", {"x": "int64"}, shard_size=bad)
    assert not (tmp_path / "w").exists()
    assert fastload.ShardWriter(tmp_path / "w", {"x": "int64"}, shard_size="1.5KB").shard_size == 1500


# -- convert options ----------------------------------------------------------------------
def test_convert_refuses_options_its_source_kind_ignores(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2), np.float32))
    (tmp_path / "imgs" / "c").mkdir(parents=True)
    with pytest.raises(ConvertError, match="--label does not apply to imagefolder sources .*class folder names"):
        fastload.convert("imagefolder", tmp_path / "imgs", tmp_path / "o", label="x", progress=False)
    with pytest.raises(ConvertError, match="--image-column does not apply to arrays"):
        fastload.convert("arrays", tmp_path / "a.npz", tmp_path / "o", image_columns=["x"], progress=False)
    with pytest.raises(ConvertError, match="--max-pixels does not apply to arrays"):
        fastload.convert("arrays", tmp_path / "a.npz", tmp_path / "o", max_pixels=100, progress=False)
    with pytest.raises(ValueError, match="workers=1.5 must be an int"):
        fastload.convert("arrays", tmp_path / "a.npz", tmp_path / "o", workers=1.5, progress=False)
    with pytest.raises(ValueError, match="shard_size=10 is 10 bytes, below the floor of 1,000,000"):
        fastload.convert("arrays", tmp_path / "a.npz", tmp_path / "o", shard_size=10, progress=False)
    assert not (tmp_path / "o").exists()
    r = fastload.convert("arrays", tmp_path / "a.npz", tmp_path / "o", shard_size=10, progress=False,
                         allow_small_shards=True)
    assert r["num_shards"] == 4


def test_cli_convert_label_and_tiny_shards(tmp_path):
    import subprocess
    import sys
    (tmp_path / "imgs" / "c").mkdir(parents=True)
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2), np.float32))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fastload", *map(str, args)], capture_output=True, text=True,
                              timeout=300)
    p = cli("convert", "imagefolder", tmp_path / "imgs", tmp_path / "o", "--label", "x")
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "--label does not apply to imagefolder" in p.stderr
    p = cli("convert", "arrays", tmp_path / "a.npz", tmp_path / "o", "--shard-size", "10", "-q")
    assert p.returncode == 1 and "below the floor" in p.stderr and "--force-small-shards" in p.stderr
    p = cli("convert", "arrays", tmp_path / "a.npz", tmp_path / "o", "--shard-size", "10", "-q",
            "--force-small-shards")
    assert p.returncode == 0 and json.loads((tmp_path / "o" / "manifest.json").read_text())["num_samples"] == 4
