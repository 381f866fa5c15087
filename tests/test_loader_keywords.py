"""One value per Loader keyword (issue 31): the Loader hands every keyword of its signature,
once, to options.build_options, which checks it and freezes it in ``Options`` (the sampler's
settings included); nothing relays them by hand."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import fastload
from fastload.loader import loader as loader_mod
from fastload.loader.options import Options, build_options

# keywords that open the data or choose the ranks (used by the Loader before the options)
OPENING = {"rank", "world_size", "mix", "epoch_size", "stop_on", "verify", "cache_dir", "cache_limit", "filesystem",
           "download_timeout", "download_threads"}
RAGGED = {"pad_value", "max_length", "pad_to_multiple", "pack_to"}  # folded into Options.ragged


def _keywords() -> list[str]:
    params = inspect.signature(fastload.Loader.__init__).parameters
    return [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]


@pytest.fixture
def ds(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[2]", "label": "int64", "w": "float32"},
                              label="label", shard_size=200) as wr:
        wr.write_batch({"x": np.zeros((40, 2), np.float32), "label": np.arange(40) % 2,
                        "w": np.ones(40, np.float32)})
    return tmp_path / "ds"


def test_every_keyword_reaches_build_options_once_with_its_value(ds, monkeypatch):
    seen = []

    def spy(d, world, **kw):
        seen.append(kw)
        return build_options(d, world, **kw)
    monkeypatch.setattr(loader_mod, "build_options", spy)
    with fastload.Loader(ds, batch_size=5, seed=11, shuffle=False, drop_last=True, prefetch=3, threads=2,
                         log_every=7, verify="off") as lo:
        assert len(lo) == 8
    assert len(seen) == 1
    kw = seen[0]
    assert set(kw) - {"mixture"} == set(_keywords())
    assert (kw["batch_size"], kw["seed"], kw["shuffle"], kw["drop_last"], kw["prefetch"], kw["threads"],
            kw["log_every"], kw["verify"]) == (5, 11, False, True, 3, 2, 7, "off")


def test_each_keyword_is_documented_and_has_its_home_in_options():
    doc = fastload.Loader.__doc__
    fields = {f.name for f in dataclasses.fields(Options)}
    for name in _keywords():
        assert name in doc, f"Loader keyword {name!r} is not in the Loader's docstring"
        assert name in fields | OPENING | RAGGED, f"Loader keyword {name!r} has no field in Options"
    assert "verify" not in fields  # the dataset's policy, read where the dataset is opened


def test_the_sampler_settings_are_frozen_in_the_options_and_build_the_sampler(ds):
    with fastload.Loader(ds, batch_size=4, shuffle=True, drop_last=True, weights="w", replacement=False,
                         num_draws=20, seed=3) as lo:
        o = lo.options
        assert (o.shuffle, o.drop_last, o.weights, o.replacement, o.num_draws, o.balance, o.shuffle_mode,
                o.window) == (True, True, "w", False, 20, False, "full", None)
        assert len(lo) == 5 and lo.sampler.drop_last
        with pytest.raises(dataclasses.FrozenInstanceError):
            o.shuffle = False
    with fastload.Loader(ds, batch_size=4, shuffle_mode="window", window=2, seed=3) as lo:
        assert (lo.options.shuffle_mode, lo.options.window) == ("window", 2)
        got = np.concatenate([b["index"].numpy() for b in lo])
        assert sorted(got.tolist()) == list(range(40))
    with fastload.Loader(ds, batch_size=4, balance=True) as lo:
        assert lo.options.balance is True


def test_the_remote_keywords_become_one_remote_options_handed_down(ds, tmp_path, monkeypatch):
    """cache_dir / cache_limit / filesystem / download_timeout / download_threads are checked
    once, into one RemoteOptions, which the Dataset (or the Mixture) the Loader opens gets as
    ``remote=`` (no dict of keywords rebuilt on the way)."""
    from fastload.loader import loader as lm
    from fastload.remote.options import RemoteOptions
    from fastload.store import mixture as mm

    opened = []
    real_dataset, real_mixture = lm.Dataset, mm.Mixture.__init__

    def dataset(path, **kw):
        opened.append(kw)
        return real_dataset(path, **kw)

    def mixture(self, *a, **kw):
        opened.append(kw)
        real_mixture(self, *a, **kw)
    monkeypatch.setattr(lm, "Dataset", dataset)
    monkeypatch.setattr(mm.Mixture, "__init__", mixture)
    with fastload.Loader(ds, batch_size=4):
        pass
    with fastload.Loader([ds, ds], mix=[1, 1], epoch_size=8, batch_size=4, fields=["x"]):
        pass
    assert [type(kw.get("remote")) for kw in opened] == [RemoteOptions, RemoteOptions]
    assert [kw["remote"].given() for kw in opened] == [[], []]
    assert not any(k in kw for kw in opened for k in ("cache_dir", "cache_limit", "filesystem"))
    with pytest.raises(ValueError, match="cache_limit"):  # checked before anything is opened
        fastload.Loader("s3://bucket/never-opened", batch_size=4, cache_limit="12 parsecs")
    assert len(opened) == 2
