"""A pad value is never silently changed into another number: every dtype refuses a value it
cannot hold exactly (naming the nearest), through the Loader and the Ring alike; the values
it does hold — decimals at its precision (0.1 for float32), NaN, infinities — still pad."""
from __future__ import annotations

import numpy as np
import pytest

import fastload
from fastload.ring.spec import RaggedField, pad_check
from fastload.store import ShardWriter

FLOATS = {"float16": 11, "float32": 24, "float64": 53}  # significand bits


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("pads") / "ds"
    rng = np.random.default_rng(3)
    lens = [1, 3, 0, 2, 4, 1]
    dtypes = [*FLOATS, "complex64", "complex128", "int32", "uint8", "int64", "bool"]
    data = {d: [rng.integers(0, 2, k).astype(d) for k in lens] for d in dtypes}
    with ShardWriter(path, {d: f"{d}[]" for d in dtypes}) as w:
        w.write_batch(data)
    return fastload.Dataset(path), data


def _loader(ds, dtype, pad):
    return fastload.Loader(ds, batch_size=6, shuffle=False, fields=[dtype], pad_value=pad)


@pytest.mark.parametrize("dtype,bits", FLOATS.items())
def test_an_integer_one_past_the_exact_range_of_a_float_is_refused(ds, dtype, bits):
    """The issue's case (16777217 for float32) for every float dtype, as an int and as a float,
    both signs, and inside a complex pad: refused naming the nearest value the dtype holds."""
    d, _ = ds
    first_gap = 2**bits + 1  # the smallest positive integer the dtype cannot hold
    for pad in (first_gap, -first_gap, float(first_gap) if bits < 53 else first_gap, np.int64(first_gap)):
        with pytest.raises(ValueError, match=rf"pad_value\['{dtype}'\]=.* is not a value of the field's dtype "
                                             rf"{dtype} \({dtype} cannot hold -?{first_gap} exactly \(the nearest "
                                             rf"{dtype} is -?{2**bits}\)\)"):
            _loader(d, dtype, pad)
    for pad in (2**bits, -(2**bits), 2**bits + 2):  # integers the dtype holds: accepted
        with _loader(d, dtype, pad) as loader:
            assert loader is not None
    if dtype == "float32":  # each part of a complex64 pad (a Python complex holds float64 parts)
        with pytest.raises(ValueError, match=r"is not a value of the field's dtype complex64 \(real part: float32 "
                                             r"cannot hold 16777217 exactly"):
            _loader(d, "complex64", complex(first_gap, 1))
        with pytest.raises(ValueError, match=r"\(imaginary part: float32 cannot hold 16777217 exactly"):
            _loader(d, "complex64", complex(1, first_gap))


@pytest.mark.parametrize("dtype,pad,nearest", [("float32", 1 / 3, "0.33333334"), ("float16", 1.0001, "1"),
                                               ("float16", 1e-8, "0"), ("float32", np.float64(np.pi), "3.1415927"),
                                               ("float16", np.float32(0.1) + np.float32(1e-6), "0.1")])
def test_a_float_with_more_precision_than_the_dtype_is_refused(ds, dtype, pad, nearest):
    d, _ = ds
    with pytest.raises(ValueError, match=rf"{dtype} cannot hold .* exactly \(the nearest {dtype} is {nearest}\)"):
        _loader(d, dtype, pad)


def test_values_a_dtype_holds_still_pad_with_exactly_that_value(ds):
    d, data = ds
    for dtype, pad, want in [("float32", 16777216, 16777216.0), ("float32", 0.1, np.float32(0.1)),
                             ("float16", 0.1, np.float16(0.1)), ("float16", np.float32(0.1), np.float16(0.1)),
                             ("float64", np.float16(0.1), float(np.float16(0.1))), ("float32", 1e20, np.float32(1e20)),
                             ("float32", 2**70, float(2**70)), ("float16", -np.inf, -np.inf),
                             ("complex64", 16777216 - 2j, np.complex64(16777216 - 2j)), ("int64", 2**63 - 1, 2**63 - 1),
                             ("uint8", 255.0, 255), ("bool", True, True)]:
        with _loader(d, dtype, pad) as loader:
            b = next(iter(loader))
        got = b[dtype].numpy()
        lens = [len(x) for x in data[dtype]]
        pads = np.concatenate([got[i, k:] for i, k in enumerate(lens)])
        assert pads.size and (pads == np.asarray(want, dtype=dtype)).all(), (dtype, pad, pads)
    with _loader(d, "float32", np.nan) as loader:
        got = next(iter(loader))["float32"].numpy()
    assert np.isnan(got[2]).all()  # the empty sample: all padding


def test_integer_dtypes_still_refuse_what_they_cannot_hold(ds):
    d, _ = ds
    for dtype, pad, why in [("int32", 2**31, r"int32 holds -2147483648\.\.2147483647"), ("uint8", -1, "uint8 holds 0..255"),
                            ("int64", 1.5, "int64 holds integers only"), ("int32", np.nan, "int32 holds integers only"),
                            ("bool", 2, r"bool holds 0\.\.1"), ("int32", 1j, "a complex number for an integer field"),
                            ("int64", 2**63, "int64 holds")]:
        with pytest.raises(ValueError, match=rf"is not a value of the field's dtype {dtype} \({why}"):
            _loader(d, dtype, pad)


def test_the_ring_refuses_the_same_pads(ds):
    from fastload.ring.ring import Ring

    vals = np.arange(6, dtype=np.float32)
    off = np.array([0, 2, 6], dtype=np.int64)
    with pytest.raises(ValueError, match=r"pad_value=16777217 is not a value of dtype float32 \(float32 cannot hold "
                                         r"16777217 exactly"):
        Ring({"r": RaggedField(np.float32, padded=True, pad_value=16777217)}, 2, {"r": [(vals, off)]})
    assert pad_check(16777217, np.float32)[0] is None and pad_check(16777216, np.float32)[0] == 16777216
