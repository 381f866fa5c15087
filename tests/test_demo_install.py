"""`fastload demo` after a plain `pip install` (no scikit-image, a test/bench extra): it still
works on synthetic images and says so; and a failed demo leaves nothing half-made behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from _zygote import run_python

# run the CLI as `python -m fastload` would, with scikit-image made unimportable
_NO_SKIMAGE = ("import runpy, sys; sys.modules['skimage'] = None; sys.argv = ['fastload'] + sys.argv[1:]; "
               "runpy.run_module('fastload', run_name='__main__')")


def test_demo_quick_without_scikit_image(tmp_path):
    out = tmp_path / "demo"
    p = run_python("-c", _NO_SKIMAGE, "demo", "--quick", "--out", out, timeout=600)  # (tests/_zygote.py)
    assert p.returncode == 0, p.stderr[-3000:]
    line1 = next(x for x in p.stdout.splitlines() if x.startswith("[1/4]"))
    assert "synthetic" in line1 and "pip install scikit-image" in line1, line1
    for step in ("[2/4]", "[3/4]", "[4/4]", "output:"):
        assert step in p.stdout, step
    r = json.loads((out / "demo-results.json").read_text())
    assert r["images"] == 96
    classes = sorted(d.name for d in (out / "images").iterdir())
    assert len(classes) >= 4
    assert sum(1 for _ in (out / "images").rglob("*.jpg")) == 96


def test_synthetic_photos_are_textured_varied_and_deterministic():
    from fastload.demo.photos import random_jpeg, synthetic_photos

    a, b = synthetic_photos(), synthetic_photos()
    assert a.keys() == b.keys() and len(a) >= 4
    for k in a:
        assert a[k].dtype == np.uint8 and a[k].ndim == 3 and a[k].shape[2] == 3
        assert np.array_equal(a[k], b[k])
        assert a[k].std() > 10  # not a flat colour
    means = [v.mean(axis=(0, 1)) for v in a.values()]
    assert len({tuple(np.round(m)) for m in means}) == len(means)  # the classes differ
    j1 = random_jpeg(a[next(iter(a))], np.random.default_rng(3))
    j2 = random_jpeg(a[next(iter(a))], np.random.default_rng(3))
    assert j1 == j2 and j1[:2] == b"\xff\xd8" and len(j1) > 5000  # JPEG, with real texture in it


def test_make_image_folder_falls_back_without_scikit_image(tmp_path, monkeypatch):
    from fastload.demo import photos as ph

    monkeypatch.setitem(sys.modules, "skimage", None)
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    assert ph.photo_source() == "synthetic"
    with pytest.raises(ImportError, match="scikit-image"):
        ph.photos()  # the real photos are still asked for explicitly
    ph.make_image_folder(tmp_path / "a", 10, seed=0, min_side=64, max_side=96)
    ph.make_image_folder(tmp_path / "b", 10, seed=0, min_side=64, max_side=96)
    fa = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert len(fa) == 10
    for f in fa:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


@pytest.mark.parametrize("exc", [RuntimeError("convert failed"), KeyboardInterrupt()])
def test_failed_demo_leaves_no_new_directory(tmp_path, monkeypatch, exc):
    import fastload.convert
    from fastload.demo import run_demo

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(fastload.convert, "convert", boom)
    out = tmp_path / "fastload-demo"
    with pytest.raises(type(exc)):
        run_demo(out, num_images=8, quick=True)
    assert not out.exists()


def test_failed_demo_in_existing_directory_removes_only_what_it_made(tmp_path, monkeypatch):
    import fastload.convert
    from fastload.demo import run_demo

    def boom(*a, **k):
        raise RuntimeError("convert failed")

    monkeypatch.setattr(fastload.convert, "convert", boom)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(RuntimeError):
        run_demo(out, num_images=8, quick=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_demo_from_the_wheel_of_a_clean_clone(tmp_path):
    """What `pip install .` installs (the wheel setuptools builds from a fresh clone's files,
    the C++ extension compiled in it) runs `fastload demo` from another directory: nothing the
    demo needs is left out of the package, and no test-only package is needed."""
    import zipfile

    from _clean_tree import build, clean_copy

    root = Path(__file__).resolve().parent.parent
    clone = tmp_path / "clone"
    clean_copy(root, clone)
    # the extension this checkout built, where setuptools' build_ext looks first: it is kept when
    # newer than csrc/ (compiling it again takes minutes on 2 cores; `make install` compiles it
    # from the same sources), else compiled here
    for so in root.glob("fastload/_C*.so"):
        lib = clone / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "fastload"
        lib.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, lib / so.name)
    wheel = build(clone, "wheel", tmp_path / "dist")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what pip would put in site-packages (no deps: installed here)
    assert list(site.glob("fastload/_C*.so")), "the wheel has no compiled extension"
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of any other fastload on the path
    code = (f"import fastload, sys; assert fastload.__file__.startswith({str(site)!r}), fastload.__file__; "
            "sys.modules['skimage'] = None; from fastload.cli import main; "
            "sys.exit(main(['demo', '--quick', '--out', 'demo']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=run_dir,
                       env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "[4/4]" in p.stdout and json.loads((run_dir / "demo" / "demo-results.json").read_text())["images"] == 96
