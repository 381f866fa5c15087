"""The bad-image policy alone (fastload/loader/decode.py), without DALI: a decoder is any
``decode(idx)`` that returns something for the indices or raises ``BadSamples`` naming the
positions it refused. The end-to-end paths through DALI are in test_loader.py and
test_lifecycle.py; these pin the policy itself."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from fastload.errors import BadSamples, DecodeError, FastloadError
from fastload.loader.decode import MAX_REPLACEMENT_ROUNDS, decode_fields, decode_with_replacement


class Decoder:
    """Refuses the samples in ``bad`` (each with its own reason); returns the indices it
    decoded otherwise; records every call."""

    def __init__(self, bad=()):
        self.bad = set(bad)
        self.calls: list[list[int]] = []

    def __call__(self, idx: np.ndarray):
        self.calls.append(idx.tolist())
        pos = [p for p, i in enumerate(idx) if int(i) in self.bad]
        if pos:
            raise BadSamples(pos, [f"corrupt JPEG #{int(idx[p])}" for p in pos])
        return idx.copy()


def describe(i: int) -> str:
    return f"shard {i // 4}, row {i % 4}, key 'img{i:03d}'"


def skip(decode, idx, **kw):
    kw.setdefault("num_samples", 10)
    return decode_with_replacement(decode, np.array(idx), on_error="skip", describe=describe, field="image", **kw)


def test_skip_replaces_by_the_next_sample_and_wraps_around():
    dec = Decoder(bad={3, 4, 9})
    out, final, replaced = skip(dec, [3, 9, 0, 7])
    assert final.tolist() == [5, 0, 0, 7]  # 3 -> 4 (bad too) -> 5; 9 -> 0 (wraps around)
    assert out.tolist() == final.tolist()  # what is returned was decoded from the final indices
    assert replaced == 3  # 3, 9, then 4
    assert dec.calls == [[3, 9, 0, 7], [4, 0, 0, 7], [5, 0, 0, 7]]


def test_skip_leaves_the_callers_indices_alone_and_is_deterministic():
    idx = np.array([3, 1])
    a = skip(Decoder(bad={3}), idx)
    b = skip(Decoder(bad={3}), idx)
    assert idx.tolist() == [3, 1]
    assert a[1].tolist() == b[1].tolist() == [4, 1] and a[2] == b[2] == 1


def test_raise_names_each_refused_sample():
    dec = Decoder(bad={4, 9})
    with pytest.raises(DecodeError) as e:
        decode_with_replacement(dec, np.array([4, 1, 9]), num_samples=10, on_error="raise", describe=describe,
                                field="photo")
    msg = str(e.value)
    assert "image field 'photo'" in msg
    assert "shard 1, row 0, key 'img004': corrupt JPEG #4" in msg
    assert "shard 2, row 1, key 'img009': corrupt JPEG #9" in msg
    assert "on_error='skip'" in msg  # what to do about it
    assert isinstance(e.value, FastloadError) and e.value.__cause__ is None
    assert len(dec.calls) == 1  # no replacement was tried


def test_other_decoder_errors_pass_through_unchanged():
    def broken(idx):
        raise RuntimeError("the pipeline itself failed")

    for mode in ("skip", "raise"):
        with pytest.raises(RuntimeError, match="the pipeline itself failed") as e:
            decode_with_replacement(broken, np.array([0]), num_samples=10, on_error=mode, describe=describe,
                                    field="image", known_bad={})
        assert not isinstance(e.value, DecodeError)


def test_known_bad_samples_are_skipped_before_decoding_and_logged_once(caplog):
    known: dict[int, str] = {}
    dec = Decoder(bad={3})
    with caplog.at_level(logging.WARNING, logger="fastload"):
        _, final, replaced = skip(dec, [3, 3, 1], known_bad=known)  # twice in one batch
        assert final.tolist() == [4, 4, 1] and replaced == 2
        assert known == {3: "corrupt JPEG #3"}
        dec.calls.clear()
        _, final2, replaced2 = skip(dec, [1, 3], known_bad=known)  # a later batch (or epoch)
    assert final2.tolist() == [1, 4] and replaced2 == 1  # still counted as a replacement
    assert dec.calls == [[1, 4]]  # the decoder never saw 3 again
    lines = [r.getMessage() for r in caplog.records if "cannot be decoded" in r.getMessage()]
    assert len(lines) == 1
    assert "shard 0, row 3, key 'img003'" in lines[0] and "corrupt JPEG #3" in lines[0]


def test_known_bad_skips_a_run_of_bad_samples_with_wrap_around():
    known = {8: "x", 9: "x", 0: "x"}
    dec = Decoder()
    _, final, replaced = skip(dec, [8, 5], known_bad=known)
    assert final.tolist() == [1, 5] and replaced == 3  # 8 -> 9 -> 0 -> 1
    assert dec.calls == [[1, 5]]


def test_known_bad_is_not_used_when_raising():
    dec = Decoder(bad={3})
    with pytest.raises(DecodeError, match="img003"):
        decode_with_replacement(dec, np.array([3]), num_samples=10, on_error="raise", describe=describe,
                                field="image", known_bad={3: "seen before"})


def test_fields_restart_so_every_field_of_a_row_is_the_same_sample():
    a, b = Decoder(), Decoder(bad={3, 4})
    results, final, replaced = decode_fields({"a": a, "b": b}, np.array([3, 1]), num_samples=10, on_error="skip",
                                             describe=describe)
    assert final.tolist() == [5, 1] and replaced == 2
    assert results["a"].tolist() == results["b"].tolist() == [5, 1]  # rows aligned across fields
    assert a.calls == [[3, 1], [5, 1]]  # decoded again with the replacement


def test_fields_need_no_restart_when_the_first_field_replaces():
    a, b = Decoder(bad={2}), Decoder()
    known: dict = {}
    results, final, replaced = decode_fields({"a": a, "b": b}, np.array([2, 7]), num_samples=10,
                                             on_error="skip", describe=describe, known_bad=known)
    assert final.tolist() == [3, 7] and replaced == 1
    assert results["a"].tolist() == results["b"].tolist() == [3, 7]
    assert a.calls == [[2, 7], [3, 7]] and b.calls == [[3, 7]]
    assert known == {"a": {2: "corrupt JPEG #2"}, "b": {}}  # one record per field


def test_fields_raise_names_the_field():
    with pytest.raises(DecodeError, match=r"image field 'mask'.*img006"):
        decode_fields({"image": Decoder(), "mask": Decoder(bad={6})}, np.array([6]), num_samples=10,
                      on_error="raise", describe=describe)


@pytest.mark.parametrize("known", [None, {}])
def test_gives_up_after_max_replacement_rounds(known):
    dec = Decoder(bad=range(10_000))  # nothing decodes
    with pytest.raises(DecodeError, match=rf"image field 'image': gave up .* after {MAX_REPLACEMENT_ROUNDS} rounds"):
        skip(dec, [0, 1], num_samples=10_000, known_bad=known)
    assert len(dec.calls) == MAX_REPLACEMENT_ROUNDS
