"""batch_transform / device_transform: where they run, errors naming the samples, and
randomness reproducible across resumes and world sizes."""
import io
import threading

import numpy as np
import pytest
import torch

import fastload
from fastload.errors import TransformError
from fastload.loader.finish import BatchInfo, derive_seeds, takes_info
from _resume import check_resume


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("tf") / "ds"
    rng = np.random.default_rng(0)
    with fastload.ShardWriter(path, {"x": "float32[4]", "label": "int64", "t": "int32[]"}, shard_size="4KB") as w:
        w.write_batch({"x": rng.standard_normal((200, 4)).astype(np.float32), "label": np.arange(200) % 5,
                       "t": [np.arange(k, dtype=np.int32) for k in rng.integers(0, 9, 200)]})
    return fastload.Dataset(path)


def test_runs_on_host_tensors_in_a_fastload_thread_and_sees_the_finished_batch(ds):
    seen = []

    def fn(batch):
        seen.append((threading.current_thread().name, sorted(batch), batch["x"].device.type))
        return {**batch, "x2": batch["x"] * 2, "onehot": torch.nn.functional.one_hot(batch["label"], 5)}

    with fastload.Loader(ds, batch_size=32, batch_transform=fn) as loader:
        for b in loader:
            assert torch.equal(b["x2"], b["x"] * 2) and b["onehot"].shape == (len(b["index"]), 5)
    assert {s[0] for s in seen} == {"fastload-transform"} and len(seen) == len(loader)
    assert seen[0][1] == ["index", "label", "t", "t_lengths", "x"] and seen[0][2] == "cpu"


def test_device_transform_runs_after_batch_transform_on_the_cpu(ds):
    calls = []

    def host(b):
        calls.append("host")
        return {**b, "y": b["x"] + 1}

    def dev(b):
        calls.append("device")
        return {**b, "z": b["y"] * 10}

    with fastload.Loader(ds, batch_size=50, batch_transform=host, device_transform=dev) as loader:
        b = next(iter(loader))
        assert torch.equal(b["z"], (b["x"] + 1) * 10)
    assert calls[:2] == ["host", "device"]


def test_an_error_names_the_batch_and_its_samples_and_earlier_batches_arrive(ds):
    def fn(batch):
        if 7 in batch["index"].tolist():
            raise ValueError("bad sample 7")
        return batch

    with fastload.Loader(ds, batch_size=16, shuffle=False, batch_transform=fn) as loader:
        it = iter(loader)
        with pytest.raises(TransformError, match=r"batch_transform .*fn failed on the batch at stream position 0 "
                                                 r"of epoch 0, samples 0, 1, 2, .*15: ValueError: bad sample 7") as e:
            next(it)
        assert isinstance(e.value.__cause__, ValueError) and isinstance(e.value, fastload.FastloadError)
    with fastload.Loader(ds, batch_size=16, shuffle=False,
                         batch_transform=lambda b: (_ for _ in ()).throw(KeyError("k")) if b["index"][0] == 32 else b
                         ) as loader:
        it = iter(loader)
        assert next(it)["index"][0] == 0 and next(it)["index"][0] == 16
        with pytest.raises(TransformError, match="stream position 32"):
            next(it)


def test_a_transform_must_return_a_dict(ds):
    with fastload.Loader(ds, batch_size=16, batch_transform=lambda b: b["x"]) as loader:
        with pytest.raises(TransformError, match="must return a dict of str -> tensor; it returned Tensor"):
            next(iter(loader))
    with pytest.raises(ValueError, match="batch_transform=3 must be a function"):
        fastload.Loader(ds, batch_size=16, batch_transform=3)


def noisy(batch, info: BatchInfo):
    """A random transform: per-batch noise from info.generator(), per-sample from sample_seeds."""
    g = info.generator()
    per_sample = torch.tensor([np.random.default_rng(s).random() for s in info.sample_seeds.tolist()])
    return {**batch, "noise": torch.rand(len(batch["index"]), generator=g), "sample_noise": per_sample}


def test_random_transforms_are_the_same_after_a_resume_at_every_batch(ds):
    full = check_resume(lambda **kw: fastload.Loader(ds, batch_size=24, seed=4, batch_transform=noisy,
                                                     fields=["x", "t"], **kw), epochs=2)
    assert not np.array_equal(full[0]["noise"], full[1]["noise"])  # each batch its own seed


def test_per_sample_seeds_do_not_depend_on_the_world_size(ds):
    def sample_noise(world_size):
        out = {}
        for r in range(world_size):
            with fastload.Loader(ds, batch_size=10, seed=1, rank=r, world_size=world_size,
                                 batch_transform=noisy) as loader:
                for b in loader:
                    out.update(zip(b["index"].tolist(), b["sample_noise"].tolist()))
        return out

    one, two = sample_noise(1), sample_noise(2)
    assert one == two and len(one) == 200


def test_seeds_and_signatures():
    s = derive_seeds(1, 0, np.arange(5))
    assert len(set(s.tolist())) == 5 and (s >= 0).all()
    assert np.array_equal(s, derive_seeds(1, 0, np.arange(5)))
    assert not np.array_equal(s, derive_seeds(1, 1, np.arange(5))) and not np.array_equal(s, derive_seeds(2, 0, np.arange(5)))
    class OneArg:
        def __call__(self, batch):
            return batch

    assert takes_info(noisy) and takes_info(lambda *a: a) and takes_info(lambda b, info=None: b)
    assert not takes_info(lambda b: b) and not takes_info(OneArg()) and not takes_info(lambda b, *, k=1: b)


def test_closing_mid_epoch_with_a_slow_transform_joins_the_thread(ds):
    import time

    def slow(b):
        time.sleep(0.01)
        return b

    with fastload.Loader(ds, batch_size=8, batch_transform=slow, prefetch=4) as loader:
        it = iter(loader)
        next(it)
        it.close()
        assert len(list(loader)) == len(loader)  # a new pass after the broken one
    # (the autouse fixture fails the test if the transform thread were left running)


def test_with_image_fields_decoded_by_dali_and_an_early_close(tmp_path):
    from PIL import Image

    from fastload.demo.photos import photos

    p = photos(["chelsea"])["chelsea"]
    with fastload.ShardWriter(tmp_path / "img", {"image": "image", "label": "int64"}) as w:
        for i in range(12):
            buf = io.BytesIO()
            Image.fromarray(p[i * 5:i * 5 + 90, :100]).save(buf, format="JPEG")
            w.write({"image": buf.getvalue(), "label": i})

    def mean_pixel(b):
        return {**b, "mean": b["image"].float().mean(dim=(1, 2, 3))}

    with fastload.Loader(tmp_path / "img", batch_size=4, shuffle=False, batch_transform=mean_pixel,
                         transforms={"image": fastload.vision.eval(32, resize=40, dtype="uint8")}) as loader:
        batches = list(loader)
        assert [b["label"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        assert all(torch.allclose(b["mean"], b["image"].float().mean(dim=(1, 2, 3))) for b in batches)
        it = iter(loader)
        next(it)
        it.close()
