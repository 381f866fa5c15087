"""Never silently nothing (issue 27): a pass keeps its owner alive, so a Loader that nobody
else holds — ``for b in fastload.Loader(path, ...)``, the way DataLoader loops are written —
delivers its whole epoch; a pass ended by anything but its data running out raises."""
import gc
import io

import numpy as np
import pytest
from PIL import Image

import fastload
from fastload.errors import PassEnded
from fastload.store.values import Ragged


N = 120


def _count(make) -> tuple[int, int]:
    """(batches, samples) of one pass over ``make()``, with the object never bound to a name
    and the collector run between batches (the way the loader was lost before)."""
    batches = samples = 0
    for b in make():
        gc.collect()
        batches += 1
        samples += len(b["index"])
    return batches, samples


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    p = tmp_path_factory.mktemp("unheld") / "raw"
    with fastload.ShardWriter(p, {"x": "float32[4]", "label": "int64"}, label="label", shard_size=600) as w:
        w.write_batch({"x": np.ones((N, 4), np.float32), "label": np.arange(N) % 3})
    return p


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    p = tmp_path_factory.mktemp("unheld") / "img"
    with fastload.ShardWriter(p, {"image": "image", "label": "int64"}, label="label") as w:
        for i in range(12):
            b = io.BytesIO()
            Image.fromarray(np.full((20, 24, 3), i * 9, np.uint8)).save(b, "PNG")
            w.write({"image": b.getvalue(), "label": i % 2})
    return p


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    p = tmp_path_factory.mktemp("unheld") / "docs"
    lens = np.arange(N) % 7 + 1
    with fastload.ShardWriter(p, {"tokens": "int32[]"}) as w:
        w.write_batch({"tokens": Ragged.from_lengths(np.arange(lens.sum(), dtype=np.int32), lens)})
    return p


def test_an_unheld_loader_delivers_its_epoch(raw):
    assert _count(lambda: fastload.Loader(str(raw), batch_size=10, device="cpu")) == (12, N)
    assert sum(1 for _ in fastload.Loader(str(raw), batch_size=10, device="cpu")) == 12
    it = iter(fastload.Loader(fastload.Dataset(raw), batch_size=25, device="cpu"))
    gc.collect()
    assert sum(1 for _ in it) == 5


def test_an_unheld_loader_with_a_batch_transform_delivers_its_epoch(raw):
    def double(b):
        b["x"] = b["x"] * 2
        return b
    assert _count(lambda: fastload.Loader(str(raw), batch_size=10, device="cpu", batch_transform=double)) == (12, N)


def test_an_unheld_image_loader_delivers_its_epoch(images):
    make = lambda: fastload.Loader(str(images), batch_size=4, device="cpu",  # noqa: E731
                                   transforms={"image": fastload.vision.eval(16)})
    assert _count(make) == (3, 12)


def test_an_unheld_mixture_loader_delivers_its_epoch(raw, docs):
    assert _count(lambda: fastload.Loader([str(raw), str(raw)], mix=[1, 1], batch_size=10, device="cpu",
                                          epoch_size=60)) == (6, 60)
    mixture = lambda: fastload.Mixture([fastload.Dataset(raw), fastload.Dataset(raw)], [1, 3],  # noqa: E731
                                       epoch_size=40)
    assert _count(lambda: fastload.Loader(mixture(), batch_size=10, device="cpu")) == (4, 40)


def test_unheld_ragged_and_packed_loaders_deliver_their_epochs(docs):
    assert _count(lambda: fastload.Loader(str(docs), batch_size=10, device="cpu")) == (12, N)
    assert _count(lambda: fastload.Loader(str(docs), batch_size=10, device="cpu", ragged="packed")) == (12, N)
    held = fastload.Loader(str(docs), batch_size=2, device="cpu", pack_to=16)
    expected = sum(1 for _ in held)
    held.close()
    assert expected > 0
    assert sum(1 for _ in fastload.Loader(str(docs), batch_size=2, device="cpu", pack_to=16)) == expected


def test_an_unheld_remote_loader_delivers_its_epoch(remote_url, tmp_path):
    with fastload.Dataset(remote_url, cache_dir=tmp_path / "c1") as ds:
        n = len(ds)
    assert _count(lambda: fastload.Loader(remote_url, batch_size=500, device="cpu",
                                          cache_dir=tmp_path / "c2")) == (-(-n // 500), n)


def test_an_unheld_dataset_iterates_every_sample(raw):
    assert sum(1 for _ in fastload.Dataset(raw)) == N
    rows = [int(s["label"]) for s in fastload.Dataset(raw)]
    assert rows == list(np.arange(N) % 3)


@pytest.mark.parametrize("end", ["close", "set_epoch", "load_state_dict", "new pass"])
def test_a_pass_ended_before_its_data_ran_out_raises(raw, end):
    loader = fastload.Loader(str(raw), batch_size=10, device="cpu")
    state = loader.state_dict()
    it = iter(loader)
    next(it)
    if end == "close":
        loader.close()
    elif end == "set_epoch":
        loader.set_epoch(1)
    elif end == "load_state_dict":
        loader.load_state_dict(state)
    else:
        assert sum(1 for _ in loader) == 12  # the new pass is whole
    with pytest.raises(PassEnded, match={"close": "closed", "set_epoch": r"set_epoch\(1\)",
                                         "load_state_dict": "load_state_dict", "new pass": "new pass"}[end]):
        next(it)
    with pytest.raises(RuntimeError):  # and again: never a quiet StopIteration
        next(it)
    loader.close()


def test_a_pass_that_failed_raises_again_instead_of_ending_quietly(raw):
    def fail_third(b):
        fail_third.calls += 1
        if fail_third.calls == 3:
            raise ValueError("boom")
        return b
    fail_third.calls = 0
    loader = fastload.Loader(str(raw), batch_size=10, device="cpu", batch_transform=fail_third, prefetch=2)
    it = iter(loader)
    got = []
    with pytest.raises(Exception, match="boom"):
        for b in it:
            got.append(b)
    assert len(got) == 2
    with pytest.raises(PassEnded, match="batch 3"):
        next(it)  # a loop that catches the error and goes on is told, not ended quietly
    assert sum(1 for _ in loader) == 12  # a new pass is whole
    loader.close()


def test_a_finished_pass_stays_finished(raw):
    loader = fastload.Loader(str(raw), batch_size=60, device="cpu")
    it = iter(loader)
    assert len(list(it)) == 2
    with pytest.raises(StopIteration):
        next(it)
    loader.close()


def test_close_does_not_wait_forever_for_pipelines_being_built(images, monkeypatch, caplog):
    """A DALI build that hangs (a stuck driver) is left to its daemon thread after a deadline."""
    import threading
    import time

    from fastload.loader import machinery
    from fastload.pipeline.runner import Runner

    release = threading.Event()
    monkeypatch.setattr(Runner, "prepare", lambda self: release.wait(60))
    monkeypatch.setattr(machinery, "WARM_JOIN_S", 0.3)
    loader = fastload.Loader(str(images), batch_size=4, device="cpu", transforms={"image": fastload.vision.eval(16)})
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="fastload"):
        loader.close()
    assert time.monotonic() - t0 < 5
    assert "did not finish within" in caplog.text
    release.set()
