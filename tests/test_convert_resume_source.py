"""``convert --resume`` never mixes two states of a source (issue 27).

A conversion is planned, some groups finish, then the source changes, then it resumes. The
result is either refused (files added or removed, a table / array / tar file rewritten: the
plan's numbering no longer fits; the error names the files) or, for files changed in place
(an image rewritten), equal sample for sample to a fresh conversion of the source as it is
now: the finished groups that read those files are converted again. A file that changes
while the conversion runs fails it (or its commit), naming the file. Every source kind, the
in-process core (plan -> run_group -> commit), an object-store DST and the CLI of the torch
engine (one rank); the Ray engine once, as the issue ran it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastload.convert import convert
from fastload.convert.commit import commit
from fastload.convert.plan import load_plan, make_plan
from fastload.convert.sourcestate import SourceChanged
from fastload.convert.task import run_group
from fastload.demo.photos import make_image_folder

from _convert import assert_same_rows, load

PARTS = ".fastload-parts"
HERE = Path(__file__).resolve().parent


# -- helpers ---------------------------------------------------------------------------------------
def plan_of(kind, src, dst, shard_size=50_000, **kw):
    return make_plan(kind, src, dst, shard_size=shard_size, overwrite=kw.pop("overwrite", False),
                     resume=kw.pop("resume", False), **kw)


def run_all(dst, plan, on_error="raise") -> list[dict]:
    out = []
    for g in range(plan.num_groups):
        r = run_group(str(dst), g, on_error)
        assert r["error"] is None, r["error"]
        out.append(r)
    return out


def rewrite(path: Path, data: bytes) -> None:
    """New bytes (and so a new size or modification time) at ``path``."""
    old = path.stat().st_mtime_ns
    path.write_bytes(data)
    if path.stat().st_mtime_ns == old:  # a coarse clock: make the change visible
        os.utime(path, ns=(old + 1_000_000_000, old + 1_000_000_000))


@pytest.fixture(scope="module")
def _folders(tmp_path_factory) -> Path:
    """The image folders below, made once per module (JPEG encoding is most of their cost)."""
    d = tmp_path_factory.mktemp("resume-src")
    make_image_folder(d / "src", 72, seed=3, min_side=64, max_side=160)
    make_image_folder(d / "other", 4, seed=9, min_side=200, max_side=240)
    return d


def _fresh_copy(template: Path, dst: Path) -> Path:
    """The test's own copy, its files written now (as if made in this test: new mtimes)."""
    return Path(shutil.copytree(template, dst, copy_function=shutil.copyfile))


@pytest.fixture
def folder(tmp_path, _folders) -> Path:
    """72 JPEGs in 3 class folders (the issue's count); ~14 per group at 50 KB shards."""
    return _fresh_copy(_folders / "src", tmp_path / "src")


@pytest.fixture
def other(tmp_path, _folders) -> list[Path]:
    """JPEGs of other sizes, to rewrite or add source images with."""
    return sorted(_fresh_copy(_folders / "other", tmp_path / "other").rglob("*.jpg"))


def images_of(src: Path) -> list[Path]:
    """The images of an image folder in source order."""
    return sorted(src.rglob("*.jpg"), key=lambda p: p.relative_to(src).as_posix())


# -- imagefolder, in process -------------------------------------------------------------------------
def test_resume_refuses_an_image_folder_with_files_added_or_removed(folder, other, tmp_path):
    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)
    assert plan.num_groups >= 4
    run_group(str(dst), 0)
    files = images_of(folder)
    rewrite(files[0], other[0].read_bytes())  # the issue: one image rewritten, one added
    shutil.copy(other[1], files[0].parent / "zzz-new.jpg")
    with pytest.raises(SourceChanged) as e:
        plan_of("imagefolder", folder, dst, resume=True)
    msg = str(e.value)
    assert "--resume refused" in msg and "1 file(s) added" in msg and "zzz-new.jpg" in msg and "--overwrite" in msg
    assert (dst / PARTS / "g-00000000").is_dir()  # nothing was thrown away by the refusal
    (files[0].parent / "zzz-new.jpg").unlink()
    files[5].unlink()
    with pytest.raises(SourceChanged, match=r"1 file\(s\) removed \(" + files[5].relative_to(folder).as_posix()):
        plan_of("imagefolder", folder, dst, resume=True)
    # --overwrite converts the source as it is now
    plan_of("imagefolder", folder, dst, overwrite=True)
    run_all(dst, load_plan(dst))
    commit(load_plan(dst))
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", dst)


def test_resume_reconverts_the_finished_groups_whose_images_changed_in_place(folder, other, tmp_path):
    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)
    for g in range(plan.num_groups - 1):  # killed before the last group
        run_group(str(dst), g)
    files = images_of(folder)
    a = files[1]                           # in group 0, finished
    b = files[plan.bounds(2)[0]]           # in group 2, finished
    c = files[-1]                          # in the last group, not converted yet
    for f, o in zip((a, b, c), other):
        rewrite(f, o.read_bytes())
    again = plan_of("imagefolder", folder, dst, resume=True)
    assert again == plan
    assert again.redo == {0: [str(a)], 2: [str(b)]}
    results = run_all(dst, again)
    assert [r["reused"] for r in results] == [g not in (0, 2, plan.num_groups - 1) for g in range(plan.num_groups)]
    commit(again)
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", dst)  # the source as it is now, sample for sample


def test_the_commit_refuses_a_file_changed_after_its_group_read_it(folder, other, tmp_path):
    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)
    run_all(dst, plan)
    files = images_of(folder)
    rewrite(files[3], other[0].read_bytes())  # while the other groups were converting
    with pytest.raises(SourceChanged) as e:
        commit(plan)
    msg = str(e.value)
    assert files[3].relative_to(folder).as_posix() in msg and "--resume" in msg and "group(s) 0 " in msg
    assert not (dst / "manifest.json").exists() and not list(dst.glob("shard-*"))
    # as the message says: --resume converts that group again, and the commit goes through
    again = plan_of("imagefolder", folder, dst, resume=True)
    assert list(again.redo) == [0]
    assert [r["reused"] for r in run_all(dst, again)] == [g != 0 for g in range(plan.num_groups)]
    commit(again)
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", dst)


def test_the_commit_refuses_an_image_added_while_the_run_went_on(folder, other, tmp_path):
    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)
    run_all(dst, plan)
    shutil.copy(other[0], folder / images_of(folder)[0].parent.name / "late.jpg")
    with pytest.raises(SourceChanged, match=r"1 file\(s\) added \(.*late\.jpg\).*--overwrite"):
        commit(plan)
    assert not (dst / "manifest.json").exists()


def test_a_file_that_changes_while_its_group_reads_it_fails_the_group(folder, other, tmp_path, monkeypatch):
    from fastload.convert.imagefolder import ImageFolderSource

    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)
    files = images_of(folder)
    victim, later = files[2], files[plan.bounds(0)[1] - 1].relative_to(folder).as_posix()
    read = ImageFolderSource.read
    reads = []

    def read_then_change(self, i):  # rewritten after the task read it (checked, then written), as it reads others
        out = read(self, i)
        reads.append(str(self.paths[i]))
        if reads.count(later) == 2:  # (each sample is read to be checked, then to be written)
            rewrite(victim, other[0].read_bytes())
        return out

    monkeypatch.setattr(ImageFolderSource, "read", read_then_change)
    r = run_group(str(dst), 0)
    assert r["error"] and "changed while it was being converted" in r["error"], r
    assert victim.relative_to(folder).as_posix() in r["error"] and "group 0" in r["error"]
    assert not (plan.parts / "g-00000000").exists() and not list(plan.parts.glob("g-00000000.attempt-*"))
    monkeypatch.undo()
    assert not run_group(str(dst), 0)["error"]  # the rerun reads it as it is now


def test_the_local_engine_writes_nothing_from_a_file_changed_while_it_was_converted(folder, other, tmp_path,
                                                                                   monkeypatch):
    from fastload.convert.imagefolder import ImageFolderSource

    files = images_of(folder)
    victim, later = files[20], files[40].relative_to(folder).as_posix()
    read = ImageFolderSource.read
    seen = []

    def read_then_change(self, i):
        out = read(self, i)
        seen.append(str(self.paths[i]))
        if seen.count(later) == 2:  # victim was read to be checked and to be written by then
            rewrite(victim, other[0].read_bytes())
        return out

    monkeypatch.setattr(ImageFolderSource, "read", read_then_change)
    dst = tmp_path / "ds"
    with pytest.raises(SourceChanged, match=victim.name):
        convert("imagefolder", folder, dst, workers=0, progress=False)
    assert seen.count(later) == 2 and not (dst / "manifest.json").exists()


# -- the other source kinds ------------------------------------------------------------------------------
def _table(tmp_path: Path, folder: Path) -> Path:
    """A Parquet file list: image paths (relative to the table's folder) and string labels."""
    files = images_of(folder)
    t = pa.table({"image": [os.path.relpath(f, tmp_path) for f in files],
                  "label": [f.parent.name for f in files]})
    pq.write_table(t, tmp_path / "list.parquet", row_group_size=16)
    return tmp_path / "list.parquet"


def test_a_file_list_table_resumes_changed_images_and_refuses_a_changed_table(folder, other, tmp_path):
    table = _table(tmp_path, folder)
    dst = tmp_path / "ds"
    plan = plan_of("table", table, dst)
    assert plan.num_groups >= 3 and plan.fingerprint and plan.fingerprint[0][0] == str(table)
    for g in range(plan.num_groups - 1):
        run_group(str(dst), g)
    files = images_of(folder)
    rewrite(files[1], other[0].read_bytes())  # an image the table names, in finished group 0
    again = plan_of("table", table, dst, resume=True)
    assert again.redo == {0: [str(files[1])]}
    assert [r["reused"] for r in run_all(dst, again)] == [g != 0 and g != plan.num_groups - 1
                                                         for g in range(plan.num_groups)]
    # the table itself rewritten (one more row) before the commit: refused, named
    t = pq.read_table(table)
    pq.write_table(pa.concat_tables([t, t.slice(0, 1)]), table, row_group_size=16)
    with pytest.raises(SourceChanged, match=r"1 file\(s\) changed \(list\.parquet\).*--overwrite"):
        commit(again)
    with pytest.raises(SourceChanged, match=r"--resume refused.*list\.parquet"):
        plan_of("table", table, dst, resume=True)
    # a task of a plan whose table changed refuses its group (no part made from the new rows)
    from fastload.convert.task import discard_group

    discard_group(again, plan.num_groups - 1)
    r = run_group(str(dst), plan.num_groups - 1)
    assert r["error"] and "list.parquet" in r["error"] and "--overwrite" in r["error"]


def test_a_csv_table_refuses_a_rewritten_file(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("x,label\n" + "".join(f"{i},{i % 3}\n" for i in range(5000)))
    dst = tmp_path / "ds"
    plan = plan_of("table", csv, dst, shard_size=20_000)
    assert plan.num_groups >= 2
    run_group(str(dst), 0)
    rewrite(csv, ("x,label\n" + "".join(f"{i + 1},{i % 3}\n" for i in range(5000))).encode())
    with pytest.raises(SourceChanged, match=r"1 file\(s\) changed \(t\.csv\)"):
        plan_of("table", csv, dst, shard_size=20_000, resume=True)


def test_arrays_refuse_npy_files_changed_added_or_removed(tmp_path):
    src = tmp_path / "arrays"
    src.mkdir()
    rng = np.random.default_rng(0)
    np.save(src / "x.npy", rng.standard_normal((6000, 8)).astype(np.float32))
    np.save(src / "label.npy", rng.integers(0, 5, 6000))
    (src / "README.txt").write_text("not read by the conversion")
    dst = tmp_path / "ds"
    plan = plan_of("arrays", src, dst, shard_size=50_000)
    assert plan.num_groups >= 3 and sorted(Path(p).name for p, *_ in plan.fingerprint) == ["label.npy", "x.npy"]
    run_group(str(dst), 0)
    (src / "README.txt").write_text("changed: not a source file")
    assert plan_of("arrays", src, dst, shard_size=50_000, resume=True).redo == {}
    np.save(src / "x.npy", rng.standard_normal((6000, 8)).astype(np.float32))  # same size, new values
    with pytest.raises(SourceChanged, match=r"1 file\(s\) changed \(x\.npy\)"):
        plan_of("arrays", src, dst, shard_size=50_000, resume=True)
    # a task started after the change refuses its group
    r = run_group(str(dst), 1)
    assert r["error"] and "x.npy" in r["error"] and "changed since the conversion was planned" in r["error"]
    np.save(src / "y.npy", rng.standard_normal((6000, 2)).astype(np.float32))
    (src / "label.npy").unlink()
    with pytest.raises(SourceChanged) as e:
        plan_of("arrays", src, dst, shard_size=50_000, resume=True)
    assert "y.npy" in str(e.value) and "label.npy" in str(e.value) and "added" in str(e.value)


def test_webdataset_refuses_a_rewritten_tar(tmp_path):
    import io

    src = tmp_path / "wds"
    src.mkdir()
    rng = np.random.default_rng(1)

    def write_tar(path: Path, start: int, n: int) -> None:
        with tarfile.open(path, "w") as tf:
            for i in range(start, start + n):
                for ext, data in (("cls", str(i % 4).encode()), ("bin", rng.bytes(2000))):
                    info = tarfile.TarInfo(f"s{i:05d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))

    write_tar(src / "a.tar", 0, 60)
    write_tar(src / "b.tar", 60, 60)
    dst = tmp_path / "ds"
    plan = plan_of("webdataset", src, dst, shard_size=50_000)
    assert plan.num_groups >= 3
    assert run_group(str(dst), 0)["error"] is None  # (a .cls label: once refused as a --label option)
    write_tar(src / "b.tar", 60, 61)  # one sample more
    with pytest.raises(SourceChanged, match=r"--resume refused.*1 file\(s\) changed \(b\.tar\)"):
        plan_of("webdataset", src, dst, shard_size=50_000, resume=True)
    r = run_group(str(dst), 1)
    assert r["error"] and "b.tar" in r["error"]


# -- an object-store DST ---------------------------------------------------------------------------------
def test_an_object_store_dst_resumes_changed_images_and_refuses_added_ones(folder, other, tmp_path, moto, s3_env,
                                                                          monkeypatch):
    from _remote import BUCKET

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{moto.endpoint}")
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    url = f"s3://{BUCKET}/resume-src"
    plan = plan_of("imagefolder", folder, url)
    for g in range(plan.num_groups - 1):
        run_group(url, g)
    files = images_of(folder)
    rewrite(files[1], other[0].read_bytes())
    again = plan_of("imagefolder", folder, url, resume=True)
    assert again.redo == {0: [str(files[1])]}
    assert [r["reused"] for r in run_all(url, again)] == [0 < g < plan.num_groups - 1 for g in range(plan.num_groups)]
    shutil.copy(other[1], files[0].parent / "late.jpg")
    with pytest.raises(SourceChanged, match=r"added \(.*late\.jpg"):
        commit(again)
    with pytest.raises(SourceChanged, match=r"--resume refused.*late\.jpg"):
        plan_of("imagefolder", folder, url, resume=True)
    (files[0].parent / "late.jpg").unlink()
    commit(again)
    from fastload.convert.publish import prefetch

    prefetch(url, tmp_path / "copy")
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", tmp_path / "copy")


# -- the CLI ------------------------------------------------------------------------------------------
def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastload", "convert", *map(str, args), "-q"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_cli_resume_says_what_it_reconverts_and_what_it_refuses(folder, other, tmp_path):
    dst = tmp_path / "ds"
    plan = plan_of("imagefolder", folder, dst)  # as a run killed after group 0 leaves it
    run_group(str(dst), 0)
    files = images_of(folder)
    rewrite(files[0], other[0].read_bytes())
    base = ["imagefolder", folder, dst, "--engine", "torch", "--shard-size", "50000", "--force-small-shards"]
    shutil.copy(other[1], files[0].parent / "zzz-new.jpg")
    p = _cli(*base, "--resume")
    assert p.returncode == 1 and "--resume refused" in p.stderr and "zzz-new.jpg" in p.stderr, p.stderr
    assert "--overwrite" in p.stderr and not (dst / "manifest.json").exists()
    (files[0].parent / "zzz-new.jpg").unlink()
    p = _cli(*base, "--resume")
    assert p.returncode == 0, p.stderr
    rel = files[0].relative_to(folder).as_posix()
    assert f"1 source file(s) had changed since their group was converted ({rel}); group(s) 0 were converted " \
           "again" in p.stdout, p.stdout
    assert f"{plan.num_groups} group(s); {plan.num_groups} converted by this run, 0 reused" in p.stdout, p.stdout
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", dst)


# -- Ray, as the issue ran it ------------------------------------------------------------------------------
have_ray = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import ray"], capture_output=True).returncode != 0,
    reason="ray is not installed (pip install 'fastload[ray]')")


@have_ray
@pytest.mark.slow
def test_ray_resume_after_an_image_was_rewritten_and_one_added(folder, other, tmp_path, ray_cluster):
    dst = tmp_path / "ds"
    base = ["imagefolder", folder, dst, "--engine", "ray", "--workers", "2", "--shard-size", "50000",
            "--force-small-shards", "--ray-address", ray_cluster.address]  # the session's Ray (tests/_ray.py)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE / "fault_site"), str(HERE.parent),
                                          os.environ.get("PYTHONPATH", "")]),
           "FASTLOAD_TEST_HEAVY": str(tmp_path / "heavy")}
    env.update(ray_cluster.env({**os.environ, "OMP_NUM_THREADS": "1", **env}))
    (tmp_path / "heavy").mkdir()
    bad = images_of(folder)[-1]
    good = bad.read_bytes()
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")  # the run stops in the last group: "killed"
    p = _cli(*base, env=env)
    assert p.returncode == 1 and not (dst / "manifest.json").exists(), p.stderr
    done = sorted((dst / PARTS).glob("g-????????"))
    assert done
    files = images_of(folder)
    rewrite(files[0], other[0].read_bytes())  # one image rewritten, one added
    shutil.copy(other[1], files[0].parent / "zzz-new.jpg")
    rewrite(bad, good)
    p = _cli(*base, "--resume", env=env)
    assert p.returncode == 1 and "--resume refused" in p.stderr and "1 file(s) added (" in p.stderr, p.stderr
    assert "zzz-new.jpg" in p.stderr and not (dst / "manifest.json").exists()
    p = _cli(*base, "--overwrite", env=env)  # as the message says
    assert p.returncode == 0, p.stderr
    convert("imagefolder", folder, tmp_path / "ref", workers=0, progress=False)
    assert_same_rows(tmp_path / "ref", dst)
    assert len(load(dst)[1]) == 73
