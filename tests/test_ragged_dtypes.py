"""Ragged fields of every stored dtype through the Loader — padded, packed and pack_to —
against a numpy reference built from the values written (bytes exact, zero-length samples
included), with NaN, complex and other pad values."""
import json
import warnings

import numpy as np
import pytest

import fastload
from fastload.store import ShardWriter
from _dtypes import DTYPES, random_values

ITEMS = {"": (), "_3": (3,)}
N = 41


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    rng = np.random.default_rng(11)
    data = {}
    for d in DTYPES:
        for suffix, item in ITEMS.items():
            lens = rng.integers(0, 9, N)
            lens[::5] = 0  # zero-length samples throughout
            data[d + suffix] = [random_values(rng, d, (int(k), *item)) for k in lens]
    fields = {n: f"{n}[]" if "_" not in n else f"{n.split('_')[0]}[*,3]" for n in data}
    path = tmp_path_factory.mktemp("dtypes") / "ds"
    with ShardWriter(path, fields, shard_size=2500) as w:
        w.write_batch(data)
    ds = fastload.Dataset(path)
    assert ds.num_shards > 2 and all(ds.fields[n].ragged for n in data)
    return ds, data


def _pad_for(dtype):
    return {"bool": True, "float16": np.nan, "float32": np.nan, "float64": -np.inf, "complex64": 1 - 2j,
            "complex128": np.nan}.get(dtype, 7 if dtype.startswith("u") else -3)


def _padded(items, pad, dtype):
    width = max(len(x) for x in items)
    out = np.full((len(items), width, *items[0].shape[1:]), pad, dtype=dtype)
    for k, x in enumerate(items):
        out[k, :len(x)] = x
    return out


@pytest.mark.parametrize("pads", [False, True])
def test_padded_every_dtype(written, pads):
    ds, data = written
    names = list(data)
    pad = {n: _pad_for(n.split("_")[0]) for n in names} if pads else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # complex fields: no ComplexWarning from checking the pads
        loader = fastload.Loader(ds, batch_size=6, seed=1, fields=names, pad_value=pad)
    with loader:
        seen = 0
        for b in loader:
            idx = b["index"].numpy()
            seen += len(idx)
            for n in names:
                dt = n.split("_")[0]
                items = [data[n][i] for i in idx]
                want = _padded(items, pad[n] if pads else 0, dt)
                got = b[n].numpy()
                assert got.dtype == np.dtype(dt) and got.shape == want.shape, n
                assert got.tobytes() == want.tobytes(), n
                assert b[n + "_lengths"].tolist() == [len(x) for x in items]
        assert seen == N
        if pads:  # NaN and complex pads survive a state round trip through JSON
            state = json.loads(json.dumps(loader.state_dict()))
            loader.load_state_dict(state)


def test_packed_every_dtype(written):
    ds, data = written
    names = list(data)
    with fastload.Loader(ds, batch_size=5, seed=2, fields=names, ragged="packed") as loader:
        for b in loader:
            idx = b["index"].numpy()
            for n in names:
                items = [data[n][i] for i in idx]
                got = b[n].numpy()
                assert got.dtype == np.dtype(n.split("_")[0]), n
                assert got.tobytes() == np.concatenate(items).tobytes() and got.shape[1:] == items[0].shape[1:], n
                assert b[n + "_offsets"].tolist() == np.concatenate([[0], np.cumsum([len(x) for x in items])]).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_to_every_dtype(written, dtype):
    ds, data = written
    stream = fastload.Sampler(len(ds), batch_size=3, seed=6).stream(0)
    tokens = np.concatenate([data[dtype][i] for i in stream])
    with fastload.Loader(ds, batch_size=3, seed=6, fields=[dtype], pack_to=10) as loader:
        got = [b[dtype].numpy() for b in loader]
    per = 3 * 10
    want = tokens[np.arange(len(got) * per) % len(tokens)]  # the last batch wraps around
    assert all(g.dtype == np.dtype(dtype) and g.shape == (3, 10) for g in got)
    assert np.concatenate([g.reshape(-1) for g in got]).tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype, pad", [("int32", np.nan), ("int32", 1.5), ("uint8", -1), ("bool", 2),
                                        ("float16", 1e6), ("float32", 1j), ("int64", "1")])
def test_pad_values_that_are_not_values_of_the_dtype_are_refused(written, dtype, pad):
    ds, _ = written
    with pytest.raises(ValueError, match=f"pad_value\\['{dtype}'\\]=.* is not a value of the field's dtype {dtype}"):
        fastload.Loader(ds, batch_size=2, fields=[dtype], pad_value=pad)


def test_a_float_pad_is_rounded_to_the_field_s_precision(written):
    """0.1 has no exact float16/float32 value: the pad is the nearest one (it was refused)."""
    ds, data = written
    with fastload.Loader(ds, batch_size=4, seed=0, fields=["float16", "float32"], pad_value=0.1) as loader:
        b = next(iter(loader))
    for n in ("float16", "float32"):
        want = _padded([data[n][i] for i in b["index"].tolist()], np.dtype(n).type(0.1), n)
        assert b[n].numpy().tobytes() == want.tobytes()
