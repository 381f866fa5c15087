"""Conversion at scale: plan -> one task per group -> commit, on Ray and on torchrun ranks.

Every distributed run is a real engine in real processes: a private Ray on 127.0.0.1 with
2 CPUs, or ``torchrun --standalone --nproc-per-node 2`` (gloo on the loopback interface).
They run in subprocesses (the CLI), so no Ray or process-group thread ever lives in the
pytest process. Faults are injected by tests/fault_site/sitecustomize.py (on PYTHONPATH).
The output must equal single-process ``convert`` sample for sample.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fastload.convert import ConvertError, convert
from fastload.convert.commit import commit
from fastload.convert.plan import PLAN, load_plan, make_plan
from fastload.convert.task import run_group
from fastload.store import verify

from _convert import assert_same_rows
from _zygote import python_shim, run_python

HERE = Path(__file__).resolve().parent
PARTS = ".fastload-parts"
SHARD = "200KB"  # ~1.7 MB of JPEGs -> 6 groups of about 55 images

have_ray = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import ray"], capture_output=True).returncode != 0,
    reason="ray is not installed (pip install 'fastload[ray]')")


# -- helpers -------------------------------------------------------------------------------
def assert_same(a: Path, b: Path) -> None:
    """The same content (``_convert.assert_same_rows``), both datasets verified, no parts left."""
    assert_same_rows(a, b)
    assert verify(a) == [] and verify(b) == []
    assert not (b / PARTS).exists()


def env_for(tmp: Path, fault_group: int | None = None, fault_when: str = "start", faults: dict | None = None) -> dict:
    """The environment of a run: the fault site (tests/fault_site) on PYTHONPATH, its records
    under ``tmp``; the first attempt of group ``fault_group`` dies at ``fault_when``, and of
    each group in ``faults`` ({group: when}) at its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE / "fault_site"), str(HERE.parent),
                                                        os.environ.get("PYTHONPATH", "")]),
           "FASTLOAD_TEST_HEAVY": str(tmp / "heavy"), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    (tmp / "heavy").mkdir(exist_ok=True)
    faults = {**({} if fault_group is None else {fault_group: fault_when}), **(faults or {})}
    if faults:
        (tmp / "faults").mkdir(exist_ok=True)
        env["FASTLOAD_TEST_FAULT"] = ",".join(f"{g}:{tmp / 'faults'}:{when}" for g, when in faults.items())
    return env


# one write per summary line: under PYTHONUNBUFFERED (CI sets it) print() writes the text and its
# newline in two calls, and two ranks sharing the pipe could land on one line
RUN_CONVERT = ("import json, sys; from fastload.convert import convert; "
        "sys.stdout.write(json.dumps(convert(**json.loads(sys.argv[1]))) + '\\n')")
_CLI_LINES = [(re.compile(r"^wrote (\d+) samples"), ("num_samples",)),
              (re.compile(r"^skipped (\d+) sample"), ("skipped",)),
              (re.compile(r"^\w+: (\d+) group\(s\); (\d+) converted by this run, (\d+) reused"),
               ("num_groups", "tasks_run", "tasks_reused"))]


def run_engine(engine: str, src: Path, dst: Path | str, tmp: Path, *, fault_group: int | None = None,
               fault_when: str = "start", ranks: int = 2, watch: set | None = None, extra_env: dict | None = None,
               cli: bool = False, cluster=None, faults: dict | None = None, **kw) -> tuple[int, dict | None, str]:
    """Run a conversion in fresh processes: the API in a subprocess, or (``cli``) the
    ``fastload convert`` command; with engine "torch", on every rank of ``torchrun
    --standalone --nproc-per-node ranks``. Returns (exit status, rank 0's summary or None,
    stderr); from the CLI the summary holds what it prints. ``watch``: a set that receives
    every IP address the processes' TCP sockets used. ``cluster``: the session's Ray
    (tests/_ray.py), joined with ``ray_address``, its workers given this run's environment."""
    env = {**env_for(tmp, fault_group, fault_when, faults), **(extra_env or {})}
    if cluster is not None:
        kw["ray_address"] = cluster.address
        env.update(cluster.env(env))
    if cli:
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in kw.items() if v is not False]
        cmd = ["-m", "fastload", "convert", "imagefolder", str(src), str(dst), f"--engine={engine}",
               f"--shard-size={SHARD}", "--force-small-shards", "-q", *flags]
    else:
        cmd = ["-c", RUN_CONVERT, json.dumps({"kind": "imagefolder", "src": str(src), "dst": str(dst), "engine": engine,
                                       "shard_size": SHARD, "allow_small_shards": True, "progress": False, **kw})]
    # forked from the tests' launcher (tests/_zygote.py), without an interpreter start-up each:
    # a driver that joins the session's Ray (whose processes are the cluster's own), and
    # torchrun's agent with its ranks (started through the launcher's python shim). Fresh
    # processes where the test watches the process tree's sockets (the ranks would not be in it).
    forked = watch is None and (engine == "torch" or (engine == "ray" and cluster is not None))
    if engine == "torch":  # torchrun: every rank runs the same command
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--no-python", str(python_shim()) if forked else sys.executable, *cmd]
    else:
        cmd = [sys.executable, *cmd]
    if forked:
        done = run_python(*cmd[1:], env=env, timeout=600, fork_python=engine == "torch")
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            addresses = _watch_addresses(p) if watch is not None else set()
            stdout, stderr = p.communicate(timeout=600)
        finally:
            if p.poll() is None:  # a hang: end the driver and every process it started, by pid
                kill_tree(p)
        code = p.returncode
        if watch is not None:
            watch.update(addresses)
    if cli:
        first = {}
        for line in stdout.splitlines():
            for rx, names in _CLI_LINES:
                m = rx.match(line)
                if m:
                    first.update(zip(names, map(int, m.groups())))
        return code, first or None, stderr
    outs = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
    first = next((o for o in outs if o.get("rank", 0) == 0), None)
    return code, first, stderr


def _watch_addresses(p: subprocess.Popen) -> set[str]:
    """Every IP address a TCP socket of ``p`` or its descendants (Ray's GCS, raylet and
    workers, the task processes) used, sampled until ``p`` exits."""
    import psutil

    seen: set[str] = set()
    root = psutil.Process(p.pid)
    while p.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for proc in procs:
            try:
                conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
            except psutil.Error:
                continue
            for c in conns:
                for a in (c.laddr, c.raddr):
                    if a:
                        try:
                            seen.add(a.ip if _is_loopback(a.ip) else f"{a.ip} ({' '.join(proc.cmdline())[:100]})")
                        except psutil.Error:
                            seen.add(a.ip)
        time.sleep(0.2)
    return seen


def _is_loopback(ip: str) -> bool:
    return ip.startswith(("127.", "::ffff:127.")) or ip in ("::1", "::", "0.0.0.0")


def non_loopback(addresses: set[str]) -> set[str]:
    """The addresses (with the process that used them) that are not this machine's loopback."""
    return {a for a in addresses if not _is_loopback(a)}


def heavy_modules(tmp: Path) -> dict:
    """Heavy modules the task processes had loaded, torch above all. DALI is expected where
    images are converted: each image is also decoded by the Loader's decoder, DALI on the
    CPU (issue 19), so a worker that ran an image task has it."""
    out = {}
    for p in (tmp / "heavy").glob("modules-*"):
        mods = [m for m in p.read_text().split() if m != "nvidia.dali"]
        if mods:
            out[p.name] = " ".join(mods)
    return out


def dali_threads(tmp: Path) -> list[int]:
    """The thread count of every DALI image check a task process built."""
    return [int(x) for p in (tmp / "heavy").glob("dali-*") for x in p.read_text().split()]


def started_groups(tmp: Path) -> set[int]:
    return {int(p.name.split("-")[1]) for p in (tmp / "heavy").glob("started-*")}


def corrupt_copy(images: Path, tmp: Path, which: int) -> tuple[Path, str]:
    """A copy of the folder where the ``which``-th image (in source order) is not a JPEG."""
    src = tmp / "images"
    shutil.copytree(images, src)
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.jpg"))
    (src / files[which]).write_bytes(b"\xff\xd8\xff\xe0 truncated, not a JPEG")
    return src, files[which]


# -- the core, in this process (no engine) ---------------------------------------------------
def inline(kind, src, dst, on_error="raise", **kw):
    plan = make_plan(kind, src, dst, shard_size=kw.pop("shard_size", 200_000), overwrite=kw.pop("overwrite", False),
                     resume=kw.pop("resume", False), **kw)
    for g in range(plan.num_groups):
        r = run_group(dst, g, on_error)
        if r["error"]:
            raise ConvertError(r["error"])
    return commit(plan, on_error)


def test_plan_is_deterministic_and_reused(images, reference, tmp_path):
    a = make_plan("imagefolder", images, tmp_path / "a", shard_size=200_000, overwrite=False, resume=False)
    b = make_plan("imagefolder", images, tmp_path / "b", shard_size=200_000, overwrite=False, resume=False)
    assert (a.group_size, a.num_groups, a.num_samples) == (b.group_size, b.num_groups, 300)
    assert a.num_groups > 3 and a.bounds(a.num_groups - 1)[1] == 300
    assert pq.read_table(a.parts / "files.parquet").equals(pq.read_table(b.parts / "files.parquet"))
    # an unfinished conversion is neither overwritten silently nor resumed with other options
    with pytest.raises(FileExistsError, match="--resume"):
        make_plan("imagefolder", images, tmp_path / "a", shard_size=200_000, overwrite=False, resume=False)
    with pytest.raises(ConvertError, match="shard_size"):
        make_plan("imagefolder", images, tmp_path / "a", shard_size=300_000, overwrite=False, resume=True)
    again = make_plan("imagefolder", images, tmp_path / "a", shard_size=200_000, overwrite=False, resume=True)
    assert again == a


def test_tasks_are_idempotent_and_the_commit_equals_local(images, reference, tmp_path):
    dst = tmp_path / "ds"
    plan = make_plan("imagefolder", images, dst, shard_size=200_000, overwrite=False, resume=False)
    first = run_group(dst, 1)
    assert not first["reused"] and first["num_samples"] == first["source_samples"]
    # a duplicate attempt finds the part done; a killed attempt's directory is ignored
    assert run_group(dst, 1)["reused"]
    (plan.parts / "g-00000002.attempt-deadbeef0000").mkdir()
    (plan.parts / "g-00000002.attempt-deadbeef0000" / "shard-00000.arrow").write_bytes(b"half")
    with pytest.raises(ConvertError, match="group 0 .*not converted"):
        commit(plan)  # every group must be there
    assert not (dst / "manifest.json").exists()
    for g in range(plan.num_groups):
        run_group(dst, g)
    r = commit(plan)
    assert r["num_samples"] == 300 and r["num_shards"] == plan.num_groups
    assert_same(reference, dst)


def test_commit_puts_moved_shards_back_when_it_fails(images, tmp_path, monkeypatch):
    dst = tmp_path / "ds"
    plan = make_plan("imagefolder", images, dst, shard_size=200_000, overwrite=False, resume=False)
    for g in range(plan.num_groups):
        run_group(dst, g)
    from fastload.convert import commit as commit_mod

    def boom(self, manifest):
        raise OSError("disk full")

    monkeypatch.setattr(commit_mod.LocalTarget, "put_manifest", boom)
    with pytest.raises(OSError, match="disk full"):
        commit(plan)
    monkeypatch.undo()
    assert not (dst / "manifest.json").exists() and not list(dst.glob("shard-*"))
    assert inline("imagefolder", images, dst, resume=True)["num_samples"] == 300


def test_overwrite_keeps_the_old_dataset_until_the_new_one_is_complete(images, reference, tmp_path):
    dst = tmp_path / "ds"
    convert("arrays", _npz(tmp_path), dst, progress=False)
    old = (dst / "manifest.json").read_text()
    src, key = corrupt_copy(images, tmp_path, 100)
    with pytest.raises(ConvertError, match=key):
        inline("imagefolder", src, dst, overwrite=True)
    assert (dst / "manifest.json").read_text() == old and verify(dst) == []
    assert (dst / PARTS / PLAN).exists()  # kept for --resume
    inline("imagefolder", images, dst, overwrite=True)  # a new plan replaces the stale parts
    assert_same(reference, dst)
    assert not list(dst.glob(".fastload-staging-*"))


def test_local_overwrite_replaces_unfinished_parts(images, reference, tmp_path):
    src, key = corrupt_copy(images, tmp_path, 100)
    dst = tmp_path / "ds"
    with pytest.raises(ConvertError, match=key):
        inline("imagefolder", src, dst)
    assert (dst / PARTS).is_dir() and not (dst / "manifest.json").exists()
    with pytest.raises(FileExistsError, match="not empty"):
        convert("imagefolder", images, dst, progress=False, workers=0)
    convert("imagefolder", images, dst, overwrite=True, progress=False, workers=0)
    assert sorted(os.listdir(dst)) == sorted(os.listdir(reference))
    assert verify(dst) == []


def _npz(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    p = tmp / "a.npz"
    np.savez(p, x=rng.standard_normal((1000, 7)).astype(np.float32), label=rng.integers(0, 5, 1000))
    return p


def test_other_kinds_split_alike(tmp_path, images):
    # arrays: bulk chunks cut at group bounds
    npz = _npz(tmp_path)
    convert("arrays", npz, tmp_path / "a_ref", progress=False)
    inline("arrays", npz, tmp_path / "a", shard_size=3000)
    assert load_plan  # noqa: B018  (imported for the plan checks above)
    assert_same(tmp_path / "a_ref", tmp_path / "a")
    # a Parquet file list (path, string label): tasks read their own row range, class
    # names come from the whole label column
    files = sorted(images.rglob("*.jpg"))
    pq.write_table(pa.table({"path": [str(p) for p in files], "label": [p.parent.name for p in files]}),
                   tmp_path / "list.parquet", row_group_size=37)
    convert("table", tmp_path / "list.parquet", tmp_path / "t_ref", progress=False, workers=0)
    inline("table", tmp_path / "list.parquet", tmp_path / "t")
    assert_same(tmp_path / "t_ref", tmp_path / "t")
    # list columns: ragged wherever some rows differ, even if one group's rows all agree
    lens = [3] * 100 + [1, 2, 5] * 20  # the first rows (and whole groups) have equal lengths
    pq.write_table(pa.table({"tok": [list(range(n)) for n in lens], "label": np.arange(len(lens)) % 3}),
                   tmp_path / "rag.parquet", row_group_size=50)
    convert("table", tmp_path / "rag.parquet", tmp_path / "r_ref", progress=False)
    inline("table", tmp_path / "rag.parquet", tmp_path / "r", shard_size=400)
    assert json.loads((tmp_path / "r" / "manifest.json").read_text())["fields"]["tok"]["kind"] == "ragged"
    assert_same(tmp_path / "r_ref", tmp_path / "r")
    # a table without image paths keys its rows by global row number
    pq.write_table(pa.table({"v": np.arange(500, dtype=np.int64), "s": [f"r{i}" for i in range(500)]}),
                   tmp_path / "plain.parquet", row_group_size=64)
    convert("table", tmp_path / "plain.parquet", tmp_path / "p_ref", progress=False)
    inline("table", tmp_path / "plain.parquet", tmp_path / "p", shard_size=1000)
    assert_same(tmp_path / "p_ref", tmp_path / "p")


def test_skip_report_has_global_indices(images, tmp_path):
    src, key = corrupt_copy(images, tmp_path, 150)  # a middle group
    convert("imagefolder", src, tmp_path / "ref", progress=False, workers=0, on_error="skip")
    r = inline("imagefolder", src, tmp_path / "ds", on_error="skip")
    assert r["skipped"] == 1
    assert_same(tmp_path / "ref", tmp_path / "ds")
    rec = [json.loads(x) for x in (tmp_path / "ds" / "skipped.jsonl").read_text().splitlines()]
    assert rec == [json.loads(x) for x in (tmp_path / "ref" / "skipped.jsonl").read_text().splitlines()]
    assert rec[0]["index"] == 150 and rec[0]["key"] == key


def test_a_group_with_every_sample_skipped_leaves_no_shard(images, tmp_path):
    src = tmp_path / "images"
    shutil.copytree(images, src)
    dst = tmp_path / "ds"
    plan = make_plan("imagefolder", src, dst, shard_size=200_000, overwrite=False, resume=False)
    a, b = plan.bounds(1)
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.jpg"))
    for f in files[a:b]:  # every image of group 1 goes bad after the plan was made
        (src / f).write_bytes(b"not an image")
    for g in range(plan.num_groups):
        assert run_group(dst, g, "skip")["error"] is None
    r = commit(plan, "skip")
    assert r["skipped"] == b - a and r["num_samples"] == 300 - (b - a) and r["num_shards"] == plan.num_groups - 1
    convert("imagefolder", src, tmp_path / "ref", progress=False, workers=0, on_error="skip")
    assert_same(tmp_path / "ref", dst)
    assert (dst / "skipped.jsonl").read_text() == (tmp_path / "ref" / "skipped.jsonl").read_text()


def test_engine_arguments_are_checked(images, tmp_path):
    with pytest.raises(ValueError, match="engine"):
        convert("imagefolder", images, tmp_path / "x", engine="spark")
    with pytest.raises(ValueError, match="ray_address"):
        convert("imagefolder", images, tmp_path / "x", ray_address="auto")
    with pytest.raises(ValueError, match="resume"):
        convert("imagefolder", images, tmp_path / "x", resume=True)


def test_a_task_checks_images_with_one_dali_thread(images, tmp_path, monkeypatch):
    """A task has one CPU (Ray's num_cpus=1, one torch worker process): its DALI decoder gets
    one thread, not one per core of the node (16 here); the local engine's writer keeps them."""
    import importlib

    imagecheck = importlib.import_module("fastload.convert.imagecheck")
    monkeypatch.setattr(imagecheck, "usable_cores", lambda: 16)
    built = []
    build = imagecheck.DaliImageCheck._build

    def counted(self):
        before = len(os.listdir("/proc/self/task"))
        pipe = build(self)
        built.append((self.threads, len(os.listdir("/proc/self/task")) - before))
        return pipe

    monkeypatch.setattr(imagecheck.DaliImageCheck, "_build", counted)
    dst = tmp_path / "ds"
    make_plan("imagefolder", images, dst, shard_size=200_000, overwrite=False, resume=False)
    assert run_group(dst, 0)["error"] is None
    assert built and all(threads == 1 and started < 16 for threads, started in built), built
    built.clear()
    convert("imagefolder", images, tmp_path / "local", workers=0, progress=False)
    assert built and built[0][0] == 16


def test_an_attempt_that_loses_the_rename_returns_the_winners_part(images, tmp_path, monkeypatch):
    import importlib

    dst = tmp_path / "ds"
    plan = make_plan("imagefolder", images, dst, shard_size=200_000, overwrite=False, resume=False)
    first = run_group(dst, 1)
    part = plan.part_dir(1)
    winner = {p.name: p.read_bytes() for p in part.iterdir()}
    # a second attempt that started before the first finished: it does not find the part,
    # converts the group, finds the part there when it renames, and keeps the winner's
    task = importlib.import_module("fastload.convert.task")
    monkeypatch.setattr(task, "finished_part", lambda part: None)
    second = run_group(dst, 1)
    assert second["reused"] and second["error"] is None and second["num_samples"] == first["num_samples"]
    assert {p.name: p.read_bytes() for p in part.iterdir()} == winner
    assert not list(plan.parts.glob("*.attempt-*"))


def test_torch_workers_are_split_between_the_ranks():
    from fastload.convert.engines.torch_engine import rank_slots

    assert [rank_slots(3, r, 2) for r in range(2)] == [2, 1]
    assert [rank_slots(8, r, 4) for r in range(4)] == [2, 2, 2, 2]
    assert [rank_slots(1, r, 2) for r in range(2)] == [1, 1]  # at least one each
    assert [rank_slots(None, r, 3) for r in range(3)] == [1, 1, 1]


def test_engine_ray_without_ray_says_how_to_install_it_before_any_work(images, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(ConvertError, match=r"needs Ray, which is not installed: pip install 'fastload\[ray\]'"):
        convert("imagefolder", images, tmp_path / "ds", engine="ray", progress=False)
    assert not (tmp_path / "ds").exists()


@have_ray
def test_a_ray_that_cannot_start_leaves_no_plan(images, tmp_path, monkeypatch):
    import importlib

    ray_engine = importlib.import_module("fastload.convert.engines.ray_engine")

    def broken():
        raise ConvertError("ray is broken here")

    monkeypatch.setattr(ray_engine, "_import_ray", broken)
    dst = tmp_path / "ds"
    with pytest.raises(ConvertError, match="ray is broken here"):
        convert("imagefolder", images, dst, engine="ray", progress=False)
    assert not (dst / PARTS).exists()  # a rerun needs neither --resume nor --overwrite


# -- Ray ---------------------------------------------------------------------------------------
@have_ray
def test_an_unreachable_ray_address_is_refused_at_once_and_leaves_no_plan(images, tmp_path):
    from _servers import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    code, _, err = run_engine("ray", images, tmp_path / "ds", tmp_path, ray_address=address, cli=True)
    assert code == 1 and f"--ray-address {address}: cannot connect to a Ray cluster" in err, err
    assert time.monotonic() - t0 < 120  # (ray.init would wait for a GCS there for minutes)
    assert not (tmp_path / "ds" / PARTS).exists()


@have_ray
@pytest.mark.slow
def test_ray_first_error_cancels_the_tasks_in_flight(images, tmp_path, ray_cluster):
    src, key = corrupt_copy(images, tmp_path, 0)  # group 0 fails at once ...
    dst = tmp_path / "ds"
    t0 = time.monotonic()
    code, _, err = run_engine("ray", src, dst, tmp_path, workers=2, cli=True, cluster=ray_cluster,
                              extra_env={"FASTLOAD_TEST_SLOW": "1:300",  # ... while group 1 runs (for 5 min)
                                         "FASTLOAD_TEST_AFTER": "0:1"})  # (group 0 fails once group 1 started)
    took = time.monotonic() - t0
    assert code == 1 and "group 0 (samples 0.." in err and key in err and "--resume" in err, err
    assert took < 200, took  # group 1 was cancelled, not waited for
    assert started_groups(tmp_path) == {0, 1}  # and no further group started
    assert not (dst / PARTS / "g-00000001").exists() and not (dst / "manifest.json").exists()


@have_ray
@pytest.mark.slow
def test_ray_equals_local_and_retries_a_killed_worker(images, reference, tmp_path):
    dst = tmp_path / "ds"
    addresses: set[str] = set()
    code, r, err = run_engine("ray", images, dst, tmp_path, fault_group=3, workers=2, watch=addresses)
    assert code == 0, err
    assert addresses and non_loopback(addresses) == set()  # the private Ray stays on 127.0.0.1
    assert (tmp_path / "faults" / "died-3").exists()  # the first attempt of group 3 died ...
    assert r["tasks_run"] == r["num_groups"] >= 5 and r["worker_pids"] >= 2  # ... and was retried
    assert_same(reference, dst)
    assert len(list((tmp_path / "heavy").glob("modules-*"))) >= 2  # every task checked its process ...
    assert heavy_modules(tmp_path) == {}  # ... no worker imported torch
    assert r["worker_heavy_modules"] in ([], ["nvidia.dali"])  # never torch (DALI: see heavy_modules)
    assert dali_threads(tmp_path) and set(dali_threads(tmp_path)) == {1}  # one DALI thread per task (num_cpus=1)


@have_ray
@pytest.mark.slow
def test_ray_failure_then_resume(images, reference, tmp_path, ray_cluster):
    src, key = corrupt_copy(images, tmp_path, 299)  # in the last group
    dst = tmp_path / "ds"
    code, _, err = run_engine("ray", src, dst, tmp_path, workers=2, cli=True, cluster=ray_cluster)
    plan = load_plan(dst)
    g = plan.num_groups - 1
    a, b = plan.bounds(g)
    assert code != 0 and f"group {g} (samples {a}..{b - 1})" in err and key in err and "--resume" in err, err
    assert not (dst / "manifest.json").exists()
    done = sorted(p.name for p in (dst / PARTS).glob("g-????????"))
    assert done and f"g-{g:08d}" not in done
    shutil.copy(images / key, src / key)  # the user fixes the file
    code, r, err = run_engine("ray", src, dst, tmp_path, workers=2, resume=True, cli=True, cluster=ray_cluster)
    assert code == 0, err
    assert r["tasks_reused"] == len(done) and r["tasks_run"] == plan.num_groups - len(done)
    assert_same(reference, dst)


@have_ray
@pytest.mark.slow
def test_ray_skip_merges_the_report(images, tmp_path, ray_cluster):
    src, key = corrupt_copy(images, tmp_path, 150)
    convert("imagefolder", src, tmp_path / "ref", progress=False, workers=0, on_error="skip")
    code, r, err = run_engine("ray", src, tmp_path / "ds", tmp_path, workers=2, on_error="skip", cluster=ray_cluster)
    assert code == 0, err
    assert r["skipped"] == 1
    assert_same(tmp_path / "ref", tmp_path / "ds")
    assert (tmp_path / "ds" / "skipped.jsonl").read_text() == (tmp_path / "ref" / "skipped.jsonl").read_text()


@have_ray
@pytest.mark.slow
def test_ray_address_joins_a_running_cluster_and_leaves_it_running(images, reference, tmp_path, ray_cluster):
    # the session's cluster (tests/_ray.py: started by a helper driver on 127.0.0.1)
    host, port = ray_cluster.address.rsplit(":", 1)
    assert host == "127.0.0.1", ray_cluster.address
    code, r, err = run_engine("ray", images, tmp_path / "ds", tmp_path, cluster=ray_cluster)
    assert code == 0, err
    assert r["workers"] == 2  # the cluster's CPUs
    assert_same(reference, tmp_path / "ds")
    assert ray_cluster.alive()  # the engine left the cluster running: its GCS still answers
    socket.create_connection((host, int(port)), timeout=10).close()


def kill_tree(p: subprocess.Popen) -> None:
    """Kill ``p`` and every process it started, by pid (never by name)."""
    import psutil

    try:
        tree = psutil.Process(p.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    p.kill()
    p.wait()
    for child in tree:
        try:
            child.kill()
        except psutil.Error:
            pass


# -- torchrun ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_killed(images, tmp_path_factory):
    """One torchrun run (2 ranks) that replaces a dataset (``overwrite``) with ``workers=3``, its
    every socket watched, where two tasks die at their first attempt: group 1 (rank 1's) with
    half a shard file written, group 2 (rank 0's) before it starts. Returns (tmp, dst, old
    shard names, exit status, summary, stderr, addresses). Two tests check what they each
    are about."""
    tmp = tmp_path_factory.mktemp("torchrun-killed")
    dst = tmp / "ds"
    convert("arrays", _npz(tmp), dst, progress=False)  # a dataset to replace
    old_shards = {n for n in os.listdir(dst) if n.startswith("shard-")}
    addresses: set[str] = set()
    code, r, err = run_engine("torch", images, dst, tmp, fault_group=1, fault_when="write", faults={2: "start"},
                              overwrite=True, workers=3, watch=addresses)
    return tmp, dst, old_shards, code, r, err, addresses


@pytest.mark.slow
def test_torchrun_overwrite_split_workers_and_a_kill_mid_write(torchrun_killed, reference):
    tmp, dst, old_shards, code, r, err, _ = torchrun_killed
    assert code == 0, err
    assert (tmp / "faults" / "died-1").exists()  # a task died with half a shard file written ...
    assert_same(reference, dst)  # ... and was retried; the old dataset is replaced
    assert not old_shards & set(os.listdir(dst)) and not list(dst.glob(".fastload-staging-*"))
    assert r["workers"] == 3 and r["worker_pids"] == 2  # 3 at once in all: 2 on rank 0, 1 on rank 1
    assert set(dali_threads(tmp)) == {1}


@pytest.mark.slow
def test_torchrun_equals_local_and_retries_a_killed_task(torchrun_killed, reference):
    tmp, dst, _, code, r, err, addresses = torchrun_killed
    assert code == 0, err
    assert addresses and non_loopback(addresses) == set()
    assert (tmp / "faults" / "died-2").exists()
    assert r["world_size"] == 2 and r["num_groups"] >= 5
    assert_same(reference, dst)
    assert heavy_modules(tmp) == {}
    assert dali_threads(tmp) and set(dali_threads(tmp)) == {1}


@pytest.mark.slow
def test_torchrun_failure_then_resume_and_skip(images, reference, tmp_path):
    src, key = corrupt_copy(images, tmp_path, 150)  # a middle group
    dst = tmp_path / "ds"
    code, _, err = run_engine("torch", src, dst, tmp_path, cli=True)
    plan = load_plan(dst)
    g = 150 // plan.group_size
    a, b = plan.bounds(g)
    assert code != 0 and f"group {g} (samples {a}..{b - 1})" in err and key in err, err
    assert not (dst / "manifest.json").exists()
    done = sorted(p.name for p in (dst / PARTS).glob("g-????????"))
    assert f"g-{g:08d}" not in done
    # resume under --on-error skip: finished parts reused, the bad image reported globally
    code, r, err = run_engine("torch", src, dst, tmp_path, resume=True, on_error="skip", cli=True)
    assert code == 0, err
    assert r["tasks_reused"] == len(done) >= 1 and r["tasks_run"] == plan.num_groups - len(done)
    assert r["skipped"] == 1 and r["num_samples"] == 299
    rec = [json.loads(x) for x in (dst / "skipped.jsonl").read_text().splitlines()]
    assert [(x["index"], x["key"]) for x in rec] == [(150, key)]
    convert("imagefolder", src, tmp_path / "ref", progress=False, workers=0, on_error="skip")
    assert_same(tmp_path / "ref", dst)
