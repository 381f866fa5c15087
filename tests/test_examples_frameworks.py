"""fastload where users train: the PyTorch Lightning and Ray Train examples, run shortened, and
the Loader's side of Lightning's resume protocol.

Each run records the sample indices every rank trained on (``--record``); the tests check that
the ranks split every epoch into disjoint shares that cover it, and that a run resumed from a
checkpoint (Lightning's own, or the one Ray hands a restarted worker group) continues at the
saved position: no sample of an epoch seen twice, none lost.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_examples import ROOT, run

LIGHTNING = ROOT / "examples" / "lightning_module.py"
# Lightning runs: forked from a launcher that imported lightning (seconds each), DDP ranks too
ON_LIGHTNING = {"preload": ("lightning",), "fork_python": True}
RAY = ROOT / "examples" / "ray_train.py"


def records(d: Path) -> dict[int, list[dict]]:
    """``{rank: [one dict per training step]}`` from an example's ``--record`` directory."""
    return {int(p.stem.removeprefix("rank")): [json.loads(line) for line in p.read_text().splitlines()]
            for p in sorted(d.glob("rank*.jsonl"))}


def indices(recs) -> list[int]:
    return [i for r in recs for i in r["index"]]


def assert_each_once(seen: list[int], n: int, what: str) -> None:
    counts = np.bincount(np.asarray(seen, dtype=np.int64), minlength=n)
    assert len(counts) == n, f"{what}: an index past the dataset"
    assert (counts == 1).all(), (f"{what}: seen twice {np.flatnonzero(counts > 1).tolist()}, "
                                 f"never {np.flatnonzero(counts == 0).tolist()}")


def loader_state_in(ckpt: Path) -> dict:
    """The Loader's state as Lightning saved it: the fit loop's ``combined_loader`` states."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    (loader_state,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return loader_state


# -- the Loader's side of Lightning's protocol (no Lightning run) ------------------------------------

@pytest.fixture
def small_ds(tmp_path):
    import fastload

    path = tmp_path / "ds"
    with fastload.ShardWriter(path, {"x": "float32[4]", "label": "int64"}) as w:
        w.write_batch({"x": np.zeros((64, 4), np.float32), "label": np.arange(64)})
    return path


def epoch_indices(loader) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


def test_loader_is_stateful_for_lightning_and_its_sampler_is_what_lightning_sets_the_epoch_on(small_ds):
    pytest.importorskip("lightning", reason="pip install 'fastload[test]' (lightning)")
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.fabric.utilities.types import _Stateful

    import fastload

    with fastload.Loader(small_ds, batch_size=16, fields=["label"]) as lo:
        assert isinstance(lo, _Stateful)  # Lightning then saves lo.state_dict() in its checkpoints
        _set_sampler_epoch(lo, 3)
        assert lo.epoch == 3


def test_a_state_at_an_epoch_end_continues_with_the_epoch_set_between_iter_and_next(small_ds):
    """Lightning resuming from a checkpoint taken at an epoch's last batch: load_state_dict,
    iter(loader), then loader.sampler.set_epoch(epoch + 1), then next(): that epoch, whole."""
    import fastload

    kw = {"batch_size": 16, "seed": 5, "fields": ["label"]}
    with fastload.Loader(small_ds, **kw) as lo:
        first = epoch_indices(lo)
        end = lo.state_dict()
        lo.sampler.set_epoch(1)  # as Lightning does (not lo.set_epoch): the state follows the sampler
        assert (lo.state_dict()["sampler"]["epoch"], lo.state_dict()["sampler"]["consumed"]) == (1, 0)
        second = epoch_indices(lo)
    assert end["sampler"]["consumed"] == 64 and sorted(i for b in second for i in b) == list(range(64)) and second != first
    with fastload.Loader(small_ds, **kw) as lo:
        lo.load_state_dict(end)
        it = iter(lo)
        lo.sampler.set_epoch(1)
        assert epoch_indices(it) == second
    with fastload.Loader(small_ds, **kw) as lo:  # nobody moved the epoch: the finished epoch has nothing left
        lo.load_state_dict(end)
        assert epoch_indices(lo) == []
    with fastload.Loader(small_ds, **kw) as lo:  # a mid-epoch state, same protocol: the rest of epoch 0
        lo.load_state_dict({**end, "sampler": {**end["sampler"], "consumed": 32}})
        it = iter(lo)
        lo.sampler.set_epoch(0)
        assert epoch_indices(it) == first[2:]


# -- Lightning ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_lightning_ddp_two_ranks_resumed_mid_epoch_from_lightnings_checkpoint(tmp_path):
    pytest.importorskip("lightning", reason="pip install 'fastload[test]' (lightning)")
    common = ["--data", tmp_path / "ds", "--devices", "2", "--batch-size", "16", "--epochs", "2",
              "--checkpoints", tmp_path / "ck"]
    run(LIGHTNING, *common, "--make-data", "256", "--max-steps", "3", "--save-every", "3",
        "--record", tmp_path / "a", cwd=tmp_path, **ON_LIGHTNING)
    a = records(tmp_path / "a")
    assert sorted(a) == [0, 1] and [len(a[r]) for r in (0, 1)] == [3, 3]
    assert not set(indices(a[0])) & set(indices(a[1]))  # the two ranks read disjoint shares
    saved = loader_state_in(tmp_path / "ck" / "step=3.ckpt")["sampler"]
    assert (saved["epoch"], saved["consumed"], saved["world_size"]) == (0, 96, 2)  # 3 steps x 2 ranks x 16

    out = run(LIGHTNING, *common, "--resume", tmp_path / "ck" / "step=3.ckpt", "--record", tmp_path / "b",
              cwd=tmp_path, **ON_LIGHTNING)
    assert "trained to epoch 2, step 16" in out
    b = records(tmp_path / "b")
    assert [r["batch_idx"] for r in b[0]] == list(range(3, 8)) + list(range(8))  # Lightning's count goes on
    for epoch in (0, 1):
        both = [r for rank in (0, 1) for r in b[rank] if r["epoch"] == epoch]
        seen = indices(both) + (indices(a[0] + a[1]) if epoch == 0 else [])
        assert_each_once(seen, 256, f"epoch {epoch}")  # both ranks together: each sample once


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory) -> Path:
    """A one-process fit of one epoch over 96 samples, checkpointed at its end (``ck/last.ckpt``),
    its batches recorded (``a/``): the run both epoch-end resumes below start from (each into a
    checkpoint directory of its own; neither changes this one's files)."""
    pytest.importorskip("lightning", reason="pip install 'fastload[test]' (lightning)")
    d = tmp_path_factory.mktemp("one-epoch")
    run(LIGHTNING, "--data", d / "ds", "--batch-size", "16", "--checkpoints", d / "ck", "--save-every", "100",
        "--make-data", "96", "--epochs", "1", "--record", d / "a", cwd=d, **ON_LIGHTNING)
    return d


@pytest.mark.slow
def test_lightning_resumed_from_an_epoch_end_checkpoint_trains_the_next_epoch(one_epoch, tmp_path):
    saved = loader_state_in(one_epoch / "ck" / "last.ckpt")["sampler"]
    assert (saved["epoch"], saved["consumed"]) == (0, 96)  # the Loader's position, in Lightning's checkpoint
    out = run(LIGHTNING, "--data", one_epoch / "ds", "--batch-size", "16", "--checkpoints", tmp_path / "ck",
              "--save-every", "100", "--epochs", "2", "--resume", one_epoch / "ck" / "last.ckpt",
              "--record", tmp_path / "b", cwd=tmp_path, **ON_LIGHTNING)
    assert "trained to epoch 2, step 12" in out
    (a,), (b,) = records(one_epoch / "a").values(), records(tmp_path / "b").values()
    assert [r["epoch"] for r in b] == [1] * 6  # epoch 1, all of it, nothing of epoch 0 again
    assert_each_once(indices(a), 96, "epoch 0")
    assert_each_once(indices(b), 96, "epoch 1")
    assert indices(a) != indices(b)  # a new order
    assert [r["index"] for r in b] == epoch_order(one_epoch / "ds", 1)  # the sampler's epoch 1


def epoch_order(ds: Path, epoch: int, batch_size: int = 16) -> list[list[int]]:
    """The batches' indices of ``epoch`` as the example's Loader reads them in one process."""
    import fastload

    with fastload.Loader(ds, batch_size=batch_size, seed=0, fields=["x", "label"], device="cpu") as lo:
        lo.set_epoch(epoch)
        return epoch_indices(lo)


@pytest.mark.slow
def test_lightning_reloading_its_dataloader_every_epoch_reads_each_epochs_order(one_epoch, tmp_path):
    """reload_dataloaders_every_n_epochs=1: Lightning calls train_dataloader() and iter(loader)
    before it sets each epoch on loader.sampler (in a resumed fit, with no second iter()):
    every epoch is still the sampler's own, in a fit resumed at an epoch's end (epoch 1) and
    at a reload within the fit (epoch 2)."""
    out = run(LIGHTNING, "--data", one_epoch / "ds", "--batch-size", "16", "--reload-every", "1",
              "--checkpoints", tmp_path / "ck", "--save-every", "100", "--epochs", "3",
              "--resume", one_epoch / "ck" / "last.ckpt", "--record", tmp_path / "b", cwd=tmp_path, **ON_LIGHTNING)
    assert "trained to epoch 3, step 18" in out
    (a,), (b,) = records(one_epoch / "a").values(), records(tmp_path / "b").values()
    assert [r["epoch"] for r in b] == [1] * 6 + [2] * 6
    orders = [[r["index"] for r in a + b if r["epoch"] == e] for e in range(3)]
    for e in range(3):
        assert orders[e] == epoch_order(one_epoch / "ds", e), f"epoch {e}"
        assert_each_once([i for batch in orders[e] for i in batch], 96, f"epoch {e}")
    assert orders[0] != orders[1] != orders[2] != orders[0]


# -- Ray Train ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ray_train_two_workers_split_each_epoch_and_a_restart_continues_at_the_checkpoint(tmp_path, ray_cluster,
                                                                                          monkeypatch):
    pytest.importorskip("ray.train", reason="pip install 'fastload[test]' (ray[train])")
    # on the session's Ray (tests/_ray.py), as on a cluster a user already runs: --address
    for k, v in ray_cluster.env({**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}).items():
        monkeypatch.setenv(k, v)
    # Ray Train's controller looks at its workers (their reports, the failure) every 2 s by default
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # 256 samples, 2 workers x 16: 8 steps an epoch; rank 1 fails at step 5, after the checkpoint of step 3
    out = run(RAY, "--data", tmp_path / "ds", "--make-data", "256", "--workers", "2", "--batch-size", "16",
              "--epochs", "2", "--save-every", "3", "--fail-at-step", "5", "--storage", tmp_path / "ray",
              "--record", tmp_path / "rec", "--address", ray_cluster.address, cwd=tmp_path, timeout=600)
    assert "finished: {'epoch': 2, 'step': 16" in out
    rec = records(tmp_path / "rec")
    assert sorted(rec) == [0, 1]
    assert [r["step"] for r in rec[1] if r["restored"] is None] == [1, 2, 3, 4, 5]  # then it failed
    assert [r["step"] for r in rec[0] if r["restored"] is None][:3] == [1, 2, 3]
    for rank in (0, 1):  # both restarted workers went on from the checkpoint of step 3
        assert [(r["step"], r["restored"]) for r in rec[rank] if r["restored"] is not None] == [
            (step, 3) for step in range(4, 17)]
    for epoch in (0, 1):
        # what counts: the first attempt up to its checkpoint, then the restarted workers
        kept = {rank: [r for r in rec[rank] if r["epoch"] == epoch and (r["restored"] is not None or r["step"] <= 3)]
                for rank in (0, 1)}
        assert not set(indices(kept[0])) & set(indices(kept[1])), f"epoch {epoch}: the ranks overlap"
        assert_each_once(indices(kept[0]) + indices(kept[1]), 256, f"epoch {epoch}")
