"""fastload.Loader end to end on the CPU: raw fields through the C++ ring, images through
DALI, sampler order, resume, errors, stats, and no thread left behind."""
from __future__ import annotations

import gc
import itertools
import json
import time

import numpy as np
import pytest
import torch

import fastload
from fastload import DecodeError, Loader, Sampler, vision
from fastload.demo.photos import photos
from _images import jpeg


@pytest.fixture(scope="module")
def raw_ds(tmp_path_factory):
    """3000 samples of (x: float32[7, 5], label: int64, w: float32, name: string) over many shards."""
    path = tmp_path_factory.mktemp("raw") / "ds"
    rng = np.random.default_rng(0)
    n = 3000
    x = rng.standard_normal((n, 7, 5)).astype(np.float32)
    with fastload.ShardWriter(path, {"x": "float32[7,5]", "label": "int64", "w": "float32", "name": "string"},
                              label="label", shard_size="64KB") as wr:
        wr.write_batch({"x": x, "label": np.arange(n) % 7, "w": (np.arange(n) % 3 + 1).astype(np.float32),
                        "name": [f"s{i}" for i in range(n)]})
    ds = fastload.Dataset(path)
    assert ds.num_shards > 5
    return ds, x


def collect(loader, limit=None):
    """The first `limit` batches (islice: no batch beyond them is taken from the loader)."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
            for b in itertools.islice(loader, limit)]


# -- raw fields --------------------------------------------------------------------------------
def test_raw_batches_equal_stored_rows_in_sampler_order(raw_ds):
    ds, x = raw_ds
    with Loader(ds, batch_size=64, seed=3, threads=2) as loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            batches = collect(loader)
            ref = Sampler(len(ds), batch_size=64, seed=3)
            ref.set_epoch(epoch)
            expected = list(ref)
            assert len(batches) == len(expected) == len(loader)
            for b, idx in zip(batches, expected):
                assert b["index"].dtype == torch.int64 and np.array_equal(b["index"].numpy(), idx)
                assert np.array_equal(b["x"].numpy(), x[idx])  # bytes equal, in the sampler's order
                assert np.array_equal(b["label"].numpy(), idx % 7)
                assert b["x"].shape == (len(idx), 7, 5) and b["x"].dtype == torch.float32
            assert sorted(np.concatenate([b["index"].numpy() for b in batches]).tolist()) == list(range(len(ds)))


def test_held_batches_never_change(raw_ds):
    """The CPU lifetime rule: a batch the user keeps is never overwritten by later batches."""
    ds, x = raw_ds
    with Loader(ds, batch_size=50, seed=0, prefetch=2) as loader:
        held = []
        for b in loader:
            held.append(b)  # keep every batch (more than the ring's slots)
        for b in held:
            assert np.array_equal(b["x"].numpy(), x[b["index"].numpy()])
        assert loader.stats()["ring"]["slots"] >= 3


def test_string_fields_and_field_selection(raw_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=10, fields=["label", "name"], shuffle=False) as loader:
        b = next(iter(loader))
        assert set(b) == {"label", "name", "index"}
        assert b["name"] == [f"s{i}" for i in range(10)]
    with pytest.raises(ValueError, match="'nope' is not a field"):
        Loader(ds, batch_size=10, fields=["nope"])


def test_early_break_exception_del_and_ctrl_c_leave_no_threads(raw_ds):
    ds, _ = raw_ds
    loader = Loader(ds, batch_size=32)
    for i, _ in enumerate(loader):
        if i == 3:
            break
    loader.close()
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    loader = Loader(ds, batch_size=32)
    with pytest.raises(ZeroDivisionError):
        for i, _ in enumerate(loader):
            if i == 2:
                1 / 0  # noqa: B018  (raises)
    del loader
    gc.collect()
    loader = Loader(ds, batch_size=32)
    with pytest.raises(KeyboardInterrupt):
        for i, _ in enumerate(loader):
            if i == 1:
                raise KeyboardInterrupt
    loader.close()
    # an iterator abandoned mid-epoch, then a new pass: restarts the epoch
    loader = Loader(ds, batch_size=1000, seed=1)
    it = iter(loader)
    next(it)
    assert len(collect(loader)) == 3
    del it, loader
    gc.collect()
    # (the autouse fixture in conftest.py fails this test if any thread is left running)


def test_len_and_world_split(raw_ds):
    ds, _ = raw_ds
    parts = []
    for rank in range(3):
        with Loader(ds, batch_size=100, rank=rank, world_size=3, seed=5) as loader:
            assert len(loader) == 10
            parts.append(np.concatenate([b["index"].numpy() for b in loader]))
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(ds)))


def test_resume_mid_epoch_same_world_equals_uninterrupted(raw_ds):
    ds, x = raw_ds
    kw = dict(batch_size=128, seed=2)
    with Loader(ds, **kw) as full_loader:
        full_loader.set_epoch(4)
        full = [b["index"].numpy().copy() for b in full_loader]
    with Loader(ds, **kw) as a:
        a.set_epoch(4)
        for i, _ in enumerate(a):
            if i == 6:
                break
        state = json.loads(json.dumps(a.state_dict()))  # plain JSON
    assert state["sampler"]["consumed"] == 7 * 128
    with Loader(ds, **kw) as b:
        b.load_state_dict(state)
        b.set_epoch(4)  # the usual loop calls set_epoch; it keeps the loaded position
        assert len(b) == len(full) - 7
        rest = [bt["index"].numpy().copy() for bt in b]
        assert all(np.array_equal(p, q) for p, q in zip(rest, full[7:])) and len(rest) == len(full) - 7
        b.set_epoch(5)
        assert len(b) == len(full)


def test_resume_on_another_world_size_reads_each_sample_once(raw_ds):
    ds, _ = raw_ds
    kw = dict(batch_size=50, seed=8)
    read = []
    state = None
    for rank in range(4):
        with Loader(ds, rank=rank, world_size=4, **kw) as lo:
            for i, b in enumerate(lo):
                read.append(b["index"].numpy().copy())
                if i == 4:
                    break
            if rank == 0:
                state = lo.state_dict()
    for rank in range(3):
        with Loader(ds, rank=rank, world_size=3, **kw) as lo:
            lo.load_state_dict(state)
            read += [b["index"].numpy().copy() for b in lo]
    counts = np.bincount(np.concatenate(read), minlength=len(ds))
    assert counts.min() == 1 and counts.sum() - len(ds) <= 2  # padding only


def test_state_from_other_data_or_settings_is_refused(raw_ds, image_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=10, seed=1) as a:
        state = a.state_dict()
    with Loader(ds, batch_size=10, seed=2) as b, pytest.raises(ValueError, match="seed"):
        b.load_state_dict(state)
    with Loader(image_ds, batch_size=10, seed=1, fields=["label"]) as c, pytest.raises(ValueError, match="dataset"):
        c.load_state_dict(state)
    with Loader(ds, batch_size=10, seed=1) as d, pytest.raises(ValueError, match="not a fastload"):
        d.load_state_dict({"foo": 1})


def test_weighted_and_balanced_sampling_through_the_loader(raw_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=70, balance=True, seed=0, fields=["label"]) as lo:
        for b in lo:
            if len(b["label"]) == 70:
                assert np.bincount(b["label"].numpy(), minlength=7).tolist() == [10] * 7
    with Loader(ds, batch_size=300, weights="w", seed=0, fields=["w"]) as lo:
        w = np.concatenate([b["w"].numpy() for b in lo])
        # weights 1, 2, 3 in equal numbers: a weight-3 sample is drawn 3x as often as weight 1
        c = np.bincount(w.astype(int), minlength=4)[1:]
        assert abs(c[2] / c[0] - 3) < 0.4
    with pytest.raises(ValueError, match="weights='label2'"):
        Loader(ds, batch_size=3, weights="label2")


def test_stats_say_where_time_went(raw_ds, image_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=10) as lo:
        n = sum(len(b["index"]) for b in lo)
        s = lo.stats()
        assert s["stages"]["gather_s"] > 0  # measured by the ring's threads
        time.sleep(0.05)
        assert lo.stats()["wall_s"] == s["wall_s"]  # a finished epoch's figures stay put
        lo.set_epoch(1)
        for i, _ in enumerate(lo):  # a new epoch starts its own counts
            if i == 2:
                break
        p = lo.stats()
        partial = p["stages"]["gather_s"]
        # The ring's gather_ns counts over the Loader's life (read after the epoch's own figure,
        # in each stats()): epoch 1's gather time is at most what was gathered since epoch 0's
        # figures were read. Counted from the Loader's start instead, it would exceed that by
        # epoch 0's gather time (a bound on counters, not a race between timings).
        assert 0 < partial <= (p["ring"]["gather_ns"] - s["ring"]["gather_ns"]) / 1e9 + 1e-12, (p, s)
    assert lo.stats()["stages"]["gather_s"] == partial  # still there after close()
    assert s["samples"] == n == len(ds) and s["batches"] == 300
    assert 0.0 <= s["wait_fraction"] <= 1.0 and s["samples_per_s"] > 0 and s["first_batch_s"] is not None
    assert set(s["stages"]) == {"gather_s", "decode_s", "copy_s"}
    assert s["stages"]["decode_s"] == 0 and s["stages"]["copy_s"] == 0  # no images, no device
    assert s["bytes"] == n * (7 * 5 * 4 + 8 + 4 + 8)  # x + label + w + index
    from fastload import vision
    with Loader(image_ds, batch_size=20, transforms={"image": vision.train(64)}, device="cpu") as lo:
        assert sum(len(b["index"]) for b in lo) == len(image_ds)
        st = lo.stats()["stages"]
    # DALI's decode and torch's resize (written into the ring slot: nothing copied), the label rows gathered
    assert st["decode_s"] > 0 and st["copy_s"] == 0 and st["gather_s"] > 0
    assert st["decode_s"] + st["copy_s"] < lo.stats()["wall_s"] * 2 + 1  # two feeders at most


STATS_KEYS = ["batches", "samples", "bytes", "wall_s", "wait_s", "wait_fraction", "batches_per_s", "samples_per_s",
              "mb_per_s", "first_batch_s", "loop_s", "bottleneck", "stages", "replaced_samples", "batches_ahead",
              "epoch", "verify"]


def test_stats_keys_from_every_part_in_one_report(raw_ds):
    """Loader.stats() is the Stats object's report: the epoch's counters, then what the parts
    registered (the epoch, the dataset's verification, the ring while it is open)."""
    ds, _ = raw_ds
    with Loader(ds, batch_size=500) as lo:
        lo.set_epoch(2)
        assert list(lo.stats()) == STATS_KEYS  # no ring before the first pass
        for _ in lo:
            pass
        s = lo.stats()
        assert list(s) == STATS_KEYS + ["ring"] and s["epoch"] == 2 and s["batches"] == 6
        assert s["ring"]["delivered"] == 6 and s["verify"]["num_shards"] == ds.num_shards
    s = lo.stats()
    assert list(s) == STATS_KEYS and s["batches"] == 6  # the ring is gone, its figures stay


def test_stats_name_the_bottleneck(raw_ds):
    from fastload.loader.stats import bottleneck

    assert bottleneck(1, 1.0, 0.9) is None  # start-up alone says nothing
    assert bottleneck(10, 1.0, 0.01) == "loop" and bottleneck(10, 1.0, 0.5) == "loader"
    assert bottleneck(10, 1.0, 0.1) == "both"
    ds, _ = raw_ds
    with Loader(ds, batch_size=300) as lo:  # a slow training step: the loader is always ahead
        for _ in lo:
            time.sleep(0.05)  # (at 0.02 s a loaded 2-core machine once read "both")
        s = lo.stats()
    assert s["bottleneck"] == "loop" and s["loop_s"] >= 0.2 and s["loop_s"] <= s["wall_s"]


def test_bad_loader_arguments(raw_ds, image_ds):
    ds, _ = raw_ds
    for kw, match in [(dict(batch_size=0), "batch_size=0"), (dict(batch_size=2, threads=0), "threads=0"),
                      (dict(batch_size=2, on_error="ignore"), "on_error"),
                      (dict(batch_size=2, rank=3, world_size=2), "rank=3"),
                      (dict(batch_size=2, device="tpu"), "device")]:
        with pytest.raises(ValueError, match=match):
            Loader(ds, **kw)
    with pytest.raises(ValueError, match=r"transforms=\{'image': fastload.vision.train\(224\)\} \("):
        Loader(image_ds, batch_size=4)  # an image field needs a transform (a snippet that parses)
    from fastload import vision
    for kw, match in [(dict(transforms={"image": vision.train}), r"not a fastload transform \(call it"),
                      (dict(transforms={"image": lambda img: img}), "not a fastload transform; use"),
                      (dict(transforms=vision.train(32)), "must be a dict"),
                      (dict(transforms={"image": vision.train(32)}, fields="image"), r"fields=\['image'\]"),
                      (dict(transforms={"image": vision.train(32)}, window=4), "only applies to shuffle_mode")]:
        with pytest.raises(ValueError, match=match):
            Loader(image_ds, batch_size=4, **kw)
    with pytest.raises(ValueError, match="CUDA is not available"):
        if not torch.cuda.is_available():
            Loader(ds, batch_size=2, device="cuda")
        else:  # pragma: no cover
            raise ValueError("CUDA is not available (skipped: there is a GPU)")


# -- images ------------------------------------------------------------------------------------
def test_images_through_dali_cpu(image_ds):
    with Loader(image_ds, batch_size=16, transforms={"image": vision.train(64)}, seed=4) as lo:
        batches = collect(lo)
        s = lo.stats()
    assert [len(b["index"]) for b in batches] == [16, 16, 16, 12]
    for b in batches:
        assert b["image"].shape[1:] == (3, 64, 64) and b["image"].dtype == torch.float32
        assert torch.isfinite(b["image"]).all() and b["image"].std() > 0.2
        assert np.array_equal(b["label"].numpy(), b["index"].numpy() % 4)
    assert s["stages"]["decode_s"] > 0 and s["replaced_samples"] == 0


def test_held_image_batches_never_change(image_ds):
    """On the CPU the presets' images are written into the ring's slots (torch finishes
    them there, no copy): a batch the user keeps, past the ring's slots and into the next
    epoch, keeps its pixels."""
    kw = dict(batch_size=8, transforms={"image": vision.train(48)}, seed=2, prefetch=2)
    with Loader(image_ds, **kw) as lo:
        ref = collect(lo)
    with Loader(image_ds, **kw) as lo:
        held = list(lo)  # the tensors themselves: views of the slots
        lo.set_epoch(1)
        later = collect(lo)
        slots = lo.stats()["ring"]["slots"]
        assert "image" in lo._machinery.ring().fields  # noqa: SLF001 - decoded into the slot
    assert len(held) == len(ref) == 8 and slots > len(held)  # the ring grew: every held batch kept its slot
    for b, r in zip(held, ref):
        assert torch.equal(b["index"], r["index"]) and torch.equal(b["image"], r["image"])
    assert not all(torch.equal(b["image"], r["image"]) for b, r in zip(later, ref))  # a new epoch, new crops


def test_same_sample_same_pixels_on_any_world_size_and_batch_size(image_ds):
    t = {"image": vision.train(48)}
    pixels = {}
    with Loader(image_ds, batch_size=7, transforms=t, seed=1) as lo:
        lo.set_epoch(2)
        for b in lo:
            for i, img in zip(b["index"].tolist(), b["image"]):
                pixels[i] = img.clone()
    for rank in range(3):
        with Loader(image_ds, batch_size=5, transforms=t, seed=1, rank=rank, world_size=3) as lo:
            lo.set_epoch(2)
            for b in lo:
                for i, img in zip(b["index"].tolist(), b["image"]):
                    assert torch.equal(img, pixels[i]), i


def test_resume_images_same_crops(image_ds):
    t = {"image": vision.train(32)}
    with Loader(image_ds, batch_size=8, transforms=t, seed=6) as lo:
        full = collect(lo)
    with Loader(image_ds, batch_size=8, transforms=t, seed=6) as lo:
        collect(lo, limit=3)
        state = lo.state_dict()
    with Loader(image_ds, batch_size=8, transforms=t, seed=6) as lo:
        lo.load_state_dict(state)
        rest = collect(lo)
    assert len(rest) == len(full) - 3
    for a, b in zip(rest, full[3:]):
        assert torch.equal(a["index"], b["index"]) and torch.equal(a["image"], b["image"])


@pytest.fixture()
def corrupt_ds(tmp_path):
    p = photos(["chelsea"])["chelsea"]
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image", "label": "int64"}, label="label") as wr:
        for i in range(12):
            if i == 5:  # bytes that are not an image, with a plausible recorded size
                wr.write({"image": b"\xff\xd8\xff" + b"junk" * 50, "label": 0}, key="bad/005.jpg",
                         image_sizes={"image": (64, 64)})
            else:
                wr.write({"image": jpeg(p[i * 10:i * 10 + 100, :120]), "label": 1}, key=f"ok/{i:03d}.jpg")
    return fastload.Dataset(tmp_path / "ds")


def test_corrupt_image_raises_naming_shard_row_and_key(corrupt_ds):
    with Loader(corrupt_ds, batch_size=4, shuffle=False, transforms={"image": vision.eval(32)}) as lo:
        it = iter(lo)
        assert len(next(it)["index"]) == 4
        with pytest.raises(DecodeError) as e:
            next(it)
    msg = str(e.value)
    assert "shard-00000.arrow" in msg and "row 5" in msg and "bad/005.jpg" in msg and "on_error='skip'" in msg


def test_corrupt_image_skip_replaces_deterministically_and_counts(corrupt_ds):
    t = {"image": vision.eval(32)}
    with Loader(corrupt_ds, batch_size=4, shuffle=False, transforms=t, on_error="skip") as lo:
        batches = collect(lo)
        s = lo.stats()
    idx = np.concatenate([b["index"].numpy() for b in batches])
    assert idx.tolist() == [0, 1, 2, 3, 4, 6, 6, 7, 8, 9, 10, 11]  # 5 -> the next sample, 6
    assert s["replaced_samples"] == 1
    assert torch.equal(batches[1]["image"][1], batches[1]["image"][2])
    assert batches[1]["label"].tolist() == [1, 1, 1, 1]  # the raw fields follow the replacement


def test_large_batches_of_unchecked_images_are_decoded_in_safe_runs(corrupt_ds, tmp_path):
    """A store written without convert's DALI check is decoded in runs of CPU_RUN images (a
    failed larger DALI run can crash the process); a converted store in whole batches."""
    from fastload.pipeline.runner import CPU_RUN

    t = {"image": vision.eval(32)}
    with Loader(corrupt_ds, batch_size=12, shuffle=False, transforms=t, on_error="skip") as lo:
        batches = collect(lo)
        runners = list(lo._machinery.decoders()._runners.values())
    assert [len(b["index"]) for b in batches] == [12] and runners and not any(r.whole_batches for r in runners)
    # a converted store: the manifest says its images were checked with DALI
    p = photos(["chelsea"])["chelsea"]
    src = tmp_path / "folder" / "cat"
    src.mkdir(parents=True)
    for i in range(CPU_RUN + 4):
        (src / f"{i:03d}.jpg").write_bytes(jpeg(p[i * 5:i * 5 + 100, :120]))
    fastload.convert("imagefolder", tmp_path / "folder", tmp_path / "conv", progress=False)
    ds = fastload.Dataset(tmp_path / "conv")
    assert ds.manifest["metadata"]["images_checked"] == "dali"
    with Loader(ds, batch_size=CPU_RUN + 4, shuffle=False, transforms=t) as lo:
        whole = collect(lo)[0]["image"]
        runners = list(lo._machinery.decoders()._runners.values())
    assert runners and all(r.whole_batches for r in runners)
    with Loader(ds, batch_size=1, shuffle=False, transforms=t) as lo:
        one = torch.cat([b["image"] for b in collect(lo)])
    assert torch.equal(whole, one)


def test_dataset_inside_a_plain_dataloader_still_works(raw_ds):
    ds, x = raw_ds
    dl = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=0)
    b = next(iter(dl))
    assert np.array_equal(b["x"].numpy(), x[:16])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_batches(raw_ds, image_ds):  # pragma: no cover - no GPU here
    ds, x = raw_ds
    with Loader(ds, batch_size=64, device="cuda") as lo:
        for b in lo:
            assert b["x"].is_cuda and b["index"].is_cuda
            assert np.array_equal(b["x"].cpu().numpy(), x[b["index"].cpu().numpy()])
    pytest.importorskip("nvidia.dali", reason="the image half needs DALI (tools/gpu_check.sh runs without it)")
    with Loader(image_ds, batch_size=16, device="cuda", transforms={"image": vision.train(64)}) as lo:
        for b in lo:
            assert b["image"].is_cuda and b["image"].shape[1:] == (3, 64, 64)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_delivery_pins_slots_and_copies_async():  # pragma: no cover - no GPU here
    from fastload.loader.cuda import CudaDelivery
    from fastload.ring.ring import Ring

    rng = np.random.default_rng(8)
    x = rng.standard_normal((1000, 784), dtype=np.float32)
    order = rng.permutation(1000)
    with Ring({"x": (np.float32, (784,)), "index": (np.int64, ())}, 64, {"x": [x]}, index_field="index",
              threads=2) as ring:
        delivery = CudaDelivery(ring, torch.device("cuda", torch.cuda.current_device()))
        ring.submit_many(np.zeros(1000, np.int64), order, index=order)
        kept = []
        for k in range(0, 1000, 64):
            batch = delivery.deliver(ring.get_batch())
            assert all(t.is_cuda for t in batch.values())
            kept.append((batch, order[k:k + 64]))  # device tensors: the host slot is recycled anyway
        torch.cuda.synchronize()
        for batch, idx in kept:
            assert np.array_equal(batch["x"].cpu().numpy(), x[idx]) and np.array_equal(batch["index"].cpu().numpy(), idx)
        s = ring.stats()
        assert delivery.pinned >= 1 and s["copies"] == 0  # (the ring may grow while copies are in flight)
        delivery.close()
        assert delivery.pinned == 0  # unregistered on close


# -- real ranks --------------------------------------------------------------------------------
def test_loader_on_real_gloo_ranks_with_resume_on_fewer_ranks(raw_ds):
    from _dist import run_ranks

    ds, _ = raw_ds
    kw = {"path": str(ds.path), "batch_size": 64, "seed": 4, "epoch": 1}
    first = run_ranks(3, "dist_jobs:loader_epoch", {**kw, "stop_after": 5})
    state = first[0]["state"]
    assert state["sampler"]["consumed"] == 5 * 64 * 3
    rest = run_ranks(2, "dist_jobs:loader_epoch", {**kw, "state": state})
    union = np.concatenate([first[0]["read"], rest[0]["read"]])
    counts = np.bincount(union, minlength=len(ds))
    assert counts.min() == 1 and counts.sum() - len(ds) <= 1
    assert all(r["rows_ok"] for r in first + rest)


def test_dataloader_with_workers_and_fastload_sampler_returns_the_loaders_samples(raw_ds):
    """The compatibility path: fastload.Dataset in a plain DataLoader with worker processes,
    batched by fastload.Sampler, gives exactly the Loader's batches (same order, same rows)."""
    ds, _ = raw_ds
    sampler = Sampler(len(ds), batch_size=100, world_size=2, rank=1, seed=9)
    dl = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2)
    via_dl = [(b["x"].numpy().copy(), b["label"].numpy().copy()) for b in dl]
    del dl
    with Loader(ds, batch_size=100, world_size=2, rank=1, seed=9, fields=["x", "label"]) as lo:
        via_loader = [(b["x"].numpy().copy(), b["label"].numpy().copy()) for b in lo]
    assert len(via_dl) == len(via_loader) == 15
    for (a, la), (b, lb) in zip(via_dl, via_loader):
        assert np.array_equal(a, b) and np.array_equal(la, lb)


def test_state_at_the_end_of_an_epoch_with_drop_last_resumes_to_nothing(raw_ds):
    ds, _ = raw_ds
    with Loader(ds, batch_size=64, world_size=7, rank=0, drop_last=True, fields=["label"]) as lo:
        n = sum(len(b["index"]) for b in lo)
        state = lo.state_dict()
    assert n == len(ds) // 7 and state["sampler"]["consumed"] >= len(ds)
    with Loader(ds, batch_size=64, world_size=2, rank=0, drop_last=True, fields=["label"]) as lo:
        lo.load_state_dict(state)
        assert len(lo) == 0 and list(lo) == []  # the dropped tail is not read on resume


def test_default_cuda_device_follows_local_rank(monkeypatch):
    """Under torchrun every rank must not pile onto cuda:0 (logic only: no GPU here)."""
    from fastload.runtime import device as L

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cur = {"d": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cur["d"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cur["d"] != 0)  # set_device initialises CUDA
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert L.default_cuda_index() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert L.default_cuda_index() == 3
    monkeypatch.setenv("LOCAL_RANK", "6")  # more ranks than GPUs on the node: wrap
    assert L.default_cuda_index() == 2
    cur["d"] = 1  # the script chose a device with torch.cuda.set_device: it wins
    assert L.default_cuda_index() == 1


def _thread_nices(prefix: str, timeout: float = 10.0) -> list[int]:
    """Nice values of this process's threads named ``prefix``... (the OS name of C++ threads,
    the Python name of Python threads; Linux /proc). Waits up to ``timeout`` for one: a C++
    thread names itself when it first runs, which on a loaded machine may be after the
    consumer gathered the first batch itself."""
    deadline = time.monotonic() + timeout
    while True:
        found = _thread_nices_now(prefix)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def _thread_nices_now(prefix: str) -> list[int]:
    import os
    import threading

    py = {t.native_id for t in threading.enumerate() if t.name.startswith(prefix)}
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name.startswith(prefix) or int(tid) in py:
            out.append(int(fields[16]))  # field 19 of stat: nice (fields[0] is field 3)
    return out


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_loader_threads_run_below_the_training_loop(raw_ds, image_ds, monkeypatch):
    from fastload.errors import UsageError
    from fastload.runtime.system import LOADER_NICE

    ds, _ = raw_ds
    with Loader(ds, batch_size=64, threads=2) as lo:
        next(iter(lo))
        ring = _thread_nices("fastload-ring")
        assert ring and set(ring) == {LOADER_NICE}
    with Loader(image_ds, batch_size=8, transforms={"image": vision.eval(32)}) as lo:
        it = iter(lo)  # the feeders live as long as the epoch's iterator
        next(it)
        feeders = _thread_nices("fastload-feeder")
        del it
        assert feeders and set(feeders) == {LOADER_NICE}
    monkeypatch.setenv("FASTLOAD_NICE", "0")
    with Loader(ds, batch_size=64, threads=2) as lo:
        next(iter(lo))
        ring = _thread_nices("fastload-ring")
        assert ring and set(ring) == {0}
    monkeypatch.setenv("FASTLOAD_NICE", "high")
    with pytest.raises(UsageError, match="FASTLOAD_NICE='high'"):
        with Loader(ds, batch_size=64) as lo:
            next(iter(lo))


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_dali_pipelines_are_built_ahead_at_the_loaders_priority(image_ds, monkeypatch):
    """The image fields' DALI pipelines are built in a thread as the Loader is made (while a
    script builds its model), not when the first batch is asked for; DALI's threads inherit
    the loader's priority from it. Batches are those of a Loader that built nothing ahead."""
    from fastload.runtime.system import LOADER_NICE

    tf = {"image": vision.train(32)}
    with Loader(image_ds, batch_size=8, transforms=tf, seed=4) as lo:
        warm = lo._machinery._warm
        assert warm is not None and warm.name == "fastload-warmup"
        warm.join(timeout=60)
        runners = lo._machinery.decoders()._runners
        assert runners and all(r._pipe is not None for r in runners.values())  # built before any iteration
        dali = _thread_nices("[DALI")
        assert dali and set(dali) == {LOADER_NICE}
        got = [b["image"].clone() for b in lo]
    from fastload.loader.machinery import Machinery

    monkeypatch.setattr(Machinery, "warm", lambda self: None)  # built by the feeders on first use
    with Loader(image_ds, batch_size=8, transforms=tf, seed=4) as lo:
        assert lo._machinery._warm is None
        want = [b["image"] for b in lo]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
