"""Ragged fields through the Loader: padded, packed and pack_to batches against a pure numpy
reference, exact resume (same and other world sizes), and bad arguments."""
import numpy as np
import pytest
import torch

import fastload
from fastload.store import ShardWriter
from fastload.store.values import Ragged
from _resume import check_resume, rows_read

N_DOCS = 150


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 0..60 tokens (int32), boxes (float32[*,4]) and a label, over several shards."""
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 60, N_DOCS)
    lens[::9] = 0
    toks = Ragged.from_lengths(rng.integers(0, 30_000, int(lens.sum()), dtype=np.int32), lens)
    nbox = rng.integers(0, 5, N_DOCS)
    boxes = [rng.standard_normal((k, 4)).astype(np.float32) for k in nbox]
    path = tmp_path_factory.mktemp("corpus") / "ds"
    with ShardWriter(path, {"tokens": "int32[]", "boxes": "float32[*,4]", "label": "int64", "name": "string"},
                     shard_size=4000) as w:
        w.write_batch({"tokens": toks, "boxes": boxes, "label": np.arange(N_DOCS) % 7,
                       "name": [f"doc{i}" for i in range(N_DOCS)]})
    ds = fastload.Dataset(path)
    assert ds.num_shards > 3
    return ds


def _sample(ds, i, field):
    return ds[int(i)][field]


def padded_reference(ds, index, field, pad=0, max_length=None, multiple=1):
    items = [_sample(ds, i, field)[:max_length] for i in index]
    width = max(len(x) for x in items)
    width = max(-(-width // multiple) * multiple, multiple if multiple > 1 else 0)
    out = np.full((len(items), width, *items[0].shape[1:]), pad, dtype=items[0].dtype)
    for k, x in enumerate(items):
        out[k, :len(x)] = x
    return out, np.array([len(x) for x in items])


@pytest.mark.parametrize("kw", [{}, {"pad_value": -7, "max_length": 20}, {"pad_to_multiple": 16},
                                {"max_length": 8, "pad_to_multiple": 8, "pad_value": {"tokens": 1, "boxes": -1.5}}])
def test_padded_batches_equal_numpy(corpus, kw):
    pad = kw.get("pad_value", 0)
    order = fastload.Sampler(len(corpus), batch_size=16, seed=3).stream(0)
    with fastload.Loader(corpus, batch_size=16, seed=3, fields=["tokens", "boxes", "label", "name"], **kw) as loader:
        seen = []
        for b in loader:
            idx = b["index"].numpy()
            seen.append(idx)
            for f in ("tokens", "boxes"):
                p = pad[f] if isinstance(pad, dict) else pad
                want, lengths = padded_reference(corpus, idx, f, p, kw.get("max_length"), kw.get("pad_to_multiple", 1))
                assert b[f].numpy().tobytes() == want.tobytes() and tuple(b[f].shape) == want.shape
                assert b[f + "_lengths"].tolist() == lengths.tolist()
            assert b["label"].tolist() == (idx % 7).tolist() and b["name"] == [f"doc{i}" for i in idx]
    assert np.array_equal(np.concatenate(seen), order)


def test_packed_batches_equal_numpy(corpus):
    with fastload.Loader(corpus, batch_size=32, seed=1, ragged="packed", max_length={"tokens": 25},
                         fields=["tokens", "boxes"]) as loader:
        for b in loader:
            idx = b["index"].numpy()
            for f, ml in (("tokens", 25), ("boxes", None)):
                items = [_sample(corpus, i, f)[:ml] for i in idx]
                assert b[f].numpy().tobytes() == np.concatenate(items).tobytes()
                assert b[f + "_offsets"].dtype == torch.int32
                assert b[f + "_offsets"].tolist() == np.concatenate([[0], np.cumsum([len(x) for x in items])]).tolist()


def pack_reference(ds, stream, rows, n, world_size=1, drop_last=False, max_length=None, start=0):
    """Every rank's batches, step by step, in pure numpy: (tokens, positions, offsets, index)."""
    docs = [_sample(ds, i, "tokens")[:max_length] for i in stream]
    tokens = np.concatenate(docs)
    doc = np.concatenate([np.full(len(d), k) for k, d in enumerate(docs)])
    pos = np.concatenate([np.arange(len(d)) for d in docs])
    total, per, step = len(tokens), rows * n, rows * n * world_size
    left = total - start
    steps = left // step if drop_last else -(-left // step)
    out = []
    for k in range(steps):
        for r in range(world_size):
            p = (start + k * step + r * per + np.arange(per)) % total
            t, d, q = tokens[p], doc[p], pos[p]
            cut = np.ones(per, bool)
            cut[1:] = (d[1:] != d[:-1]) | (q[1:] != q[:-1] + 1)
            cut[::n] = True  # every row starts a piece
            starts = np.flatnonzero(cut)
            out.append({"tokens": t.reshape(rows, n), "tokens_positions": q.reshape(rows, n),
                        "tokens_offsets": np.append(starts, per).astype(np.int32), "index": stream[d[starts]]})
    return out


@pytest.mark.parametrize("drop_last, max_length", [(False, None), (True, 40)])
def test_pack_to_rows_equal_numpy(corpus, drop_last, max_length):
    stream = fastload.Sampler(len(corpus), batch_size=4, seed=5).stream(0)
    want = pack_reference(corpus, stream, 4, 64, drop_last=drop_last, max_length=max_length)
    with fastload.Loader(corpus, batch_size=4, seed=5, pack_to=64, drop_last=drop_last, max_length=max_length,
                         fields=["tokens", "label"]) as loader:
        got = list(loader)
        assert len(loader) == len(want) == len(got)
    for g, w in zip(got, want):
        for k, v in w.items():
            assert g[k].numpy().tolist() == v.tolist(), k
        assert g["label"].tolist() == (w["index"] % 7).tolist()  # other fields: one row per piece
        assert g["tokens_positions"].dtype == torch.int64


def test_pack_to_every_token_once_across_ranks_and_resume_at_another_world_size(corpus):
    def make(rank=0, world_size=1):
        return fastload.Loader(corpus, batch_size=2, seed=9, pack_to=48, rank=rank, world_size=world_size,
                               drop_last=True, fields=["tokens"])

    stream = fastload.Sampler(len(corpus), batch_size=2, seed=9).stream(0)
    tokens = np.concatenate([_sample(corpus, i, "tokens") for i in stream])
    full, _ = rows_read(make, 3, key="tokens")
    step = 3 * 2 * 48
    assert np.array_equal(full.reshape(-1), tokens[:len(tokens) // step * step])
    # 3 ranks stop after 4 steps; 2 ranks finish the epoch from there, inside documents
    head, state = rows_read(make, 3, stop_after=4, key="tokens")
    assert state["sampler"]["consumed"] == 4 * step
    tail, _ = rows_read(make, 2, state=state, key="tokens")
    got = np.concatenate([head.reshape(-1), tail.reshape(-1)])
    end = 4 * step + (len(tokens) - 4 * step) // (2 * 2 * 48) * (2 * 2 * 48)
    assert np.array_equal(got, tokens[:end])


@pytest.mark.parametrize("kw", [{"pack_to": 40}, {"ragged": "packed"}, {"pad_to_multiple": 4}])
def test_resume_equals_the_uninterrupted_run_at_every_batch(corpus, kw):
    fields = ["tokens", "label"] if "pack_to" in kw else ["tokens", "boxes", "label", "name"]
    full = check_resume(lambda **extra: fastload.Loader(corpus, batch_size=8, seed=2, fields=fields, **kw, **extra),
                        epochs=2)
    assert len(full) > 10


def test_a_state_of_other_ragged_settings_is_refused(corpus):
    with fastload.Loader(corpus, batch_size=4, pack_to=32, fields=["tokens"]) as a:
        state = a.state_dict()
    with fastload.Loader(corpus, batch_size=4, pack_to=64, fields=["tokens"]) as b:
        with pytest.raises(ValueError, match="mismatch in ragged"):
            b.load_state_dict(state)


@pytest.mark.parametrize("kw, err", [
    ({"pack_to": 16}, "pack_to packs one ragged field"),
    ({"pack_to": 0, "fields": ["tokens"]}, "pack_to=0 must be an int > 0"),
    ({"pack_to": 16, "fields": ["boxes"]}, "pack_to packs 1-d sequences"),
    ({"ragged": "ragged"}, r"ragged\['tokens'\]='ragged' must be one of"),
    ({"pad_value": 2**40, "fields": ["tokens"]}, "pad_value.*is not a value of the field's dtype int32"),
    ({"ragged": "packed", "pad_value": 1, "fields": ["tokens"]}, "delivered packed"),
    ({"max_length": {"label": 3}}, "'label' is not a delivered ragged field"),
    ({"pad_value": 0, "fields": ["label"]}, "pad_value= applies to ragged fields"),
])
def test_bad_ragged_arguments_are_named(corpus, kw, err):
    with pytest.raises(ValueError, match=err):
        fastload.Loader(corpus, batch_size=4, **kw)


def test_a_field_shadowed_by_a_delivered_key_is_refused(tmp_path):
    with ShardWriter(tmp_path / "ds", {"t": "int32[]", "t_lengths": "int64"}) as w:
        w.write({"t": [1, 2], "t_lengths": 2})
    with pytest.raises(ValueError, match="'t_lengths' would be shadowed"):
        fastload.Loader(tmp_path / "ds", batch_size=1)
    with fastload.Loader(tmp_path / "ds", batch_size=1, ragged="packed") as loader:  # then no _lengths
        assert next(iter(loader))["t_lengths"].tolist() == [2]


def test_batches_larger_than_the_slot_region_and_held_batches(corpus, monkeypatch):
    from fastload.loader import ragged

    monkeypatch.setattr(ragged, "RAGGED_SLOT_BUDGET", 64)  # almost every batch gets memory of its own
    with fastload.Loader(corpus, batch_size=16, seed=4, fields=["tokens"], ragged="packed") as loader:
        held = list(loader)
    for b in held:
        items = [_sample(corpus, i, "tokens") for i in b["index"].numpy()]
        assert b["tokens"].numpy().tobytes() == np.concatenate(items).tobytes()


def test_packed_resume_on_real_ranks_at_another_world_size(corpus):
    from _dist import run_ranks

    stream = fastload.Sampler(len(corpus), batch_size=2, seed=9).stream(0)
    tokens = np.concatenate([_sample(corpus, i, "tokens") for i in stream])
    first = run_ranks(3, "dist_jobs:packed_epoch", {"path": str(corpus.path), "stop_after": 3})
    state = first[0]["state"]
    assert state["sampler"]["consumed"] == 3 * 3 * 2 * 48  # tokens, not samples
    rest = run_ranks(2, "dist_jobs:packed_epoch", {"path": str(corpus.path), "state": state})
    got = np.array(first[0]["read"] + rest[0]["read"])
    assert len(got) > len(tokens) // 2 and np.array_equal(got, tokens[:len(got)])


def test_images_with_ragged_captions_and_a_replaced_undecodable_image(tmp_path):
    """The image feeder fills the slot; the ring gathers the captions into it (also again for
    samples that replace an undecodable image), padded per batch."""
    import io

    from PIL import Image

    from fastload.demo.photos import photos

    p = photos(["coffee"])["coffee"]
    caps = [np.arange(i % 5 + i // 5, dtype=np.int32) + 100 * i for i in range(16)]
    with ShardWriter(tmp_path / "ds", {"image": "image", "caption": "int32[]"}) as w:
        for i in range(16):
            buf = io.BytesIO()
            Image.fromarray(p[i:i + 80, i:i + 90]).save(buf, format="JPEG")
            data = buf.getvalue() if i != 6 else b"\xff\xd8\xff" + b"junk" * 40
            w.write({"image": data, "caption": caps[i]}, image_sizes={"image": (90, 80)})
    with fastload.Loader(tmp_path / "ds", batch_size=4, shuffle=False, on_error="skip", pad_value=-1,
                         transforms={"image": fastload.vision.eval(32, resize=36, dtype="uint8")}) as loader:
        batches = list(loader)
    idx = np.concatenate([b["index"].numpy() for b in batches])
    assert 6 not in idx and 7 in idx and len(idx) == 16  # sample 6 replaced by the next one
    for b in batches:
        want, lengths = padded_reference_list([caps[i] for i in b["index"].tolist()], -1)
        assert b["caption"].tolist() == want.tolist() and b["caption_lengths"].tolist() == lengths
        assert b["image"].shape == (4, 32, 32, 3) or b["image"].shape == (4, 3, 32, 32)


def padded_reference_list(items, pad):
    width = max(len(x) for x in items)
    out = np.full((len(items), width), pad, np.int32)
    for k, x in enumerate(items):
        out[k, :len(x)] = x
    return out, [len(x) for x in items]
