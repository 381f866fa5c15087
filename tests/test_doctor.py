"""fastload doctor: each verdict from given facts (no machine needed), and the real command
on this machine (no GPU: the CUDA graphs are validated offline and it says so)."""
from __future__ import annotations

import io
import os
import resource
import subprocess
import sys

import numpy as np
import pytest

import fastload
from fastload import doctor
from fastload.doctor import FAIL, NO_GPU_NOTE, OK, WARN, Facts


def gpu_host(**kw) -> Facts:
    """A healthy 8-GPU node as the facts describe it; tests change one thing at a time."""
    base = dict(device="cuda", driver="550.54.15", driver_cuda=12040, gpus=["NVIDIA H100 80GB HBM3"] * 8,
                torch_version="2.13.0+cu124", torch_cuda="12.4", torch_gpus=8, dali_version="2.4.0",
                dali_cuda_major=12, memlock=(-1, -1), nofile=(65536, 65536), shm=(64 << 30, 60 << 30),
                cores=64, local_world_size=8, local_world_size_set=True, local_rank=3, torch_threads=1, gather_threads=7, dali_threads=8)
    base.update(kw)
    return Facts(**base)


def verdicts(f: Facts) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.message) for c in doctor.assess(f)}


def test_a_healthy_gpu_node_is_all_ok():
    v = verdicts(gpu_host())
    assert {s for s, _ in v.values()} == {OK}, v
    assert v["gpu"][1].startswith("8 visible: NVIDIA H100 80GB HBM3") and "driver 550.54.15 (CUDA 12.4)" in v["gpu"][1]
    assert "summary" not in v  # something can run on a device: no no-GPU note


@pytest.mark.parametrize("change, name, status, words", [
    (dict(driver=None, driver_cuda=None, gpus=[], torch_gpus=0, torch_cuda=None), "gpu", WARN, NO_GPU_NOTE),
    (dict(torch_gpus=0, torch_cuda=None, torch_version="2.13.0+cpu"), "gpu", FAIL, "CPU-only build"),
    (dict(torch_gpus=0), "gpu", FAIL, "CUDA_VISIBLE_DEVICES"),
    (dict(torch_gpus=1, gpus=["A10"]), "gpu", WARN, "8 local ranks share 1 GPU"),
    (dict(torch_cuda=None, torch_gpus=0), "torch", FAIL, "CPU-only build"),
    (dict(driver=None, driver_cuda=None, gpus=[], torch_gpus=0, torch_cuda=None), "torch", WARN, "CPU-only"),
    (dict(driver_cuda=11080), "torch", FAIL, "supports CUDA 11.8 only"),
    (dict(driver_cuda=12020), "torch", WARN, "minor version compatibility"),
    (dict(dali_version=None, dali_error="No module named 'nvidia'"), "dali", FAIL, "cannot be imported"),
    (dict(torch_cuda="13.0", driver_cuda=13000), "dali", FAIL, "two CUDA major versions"),
    (dict(driver_cuda=11080, torch_cuda="11.8"), "dali", FAIL, "nvidia-dali-cuda110"),
    (dict(dali_missing_libs=["NPP"]), "dali", WARN, "pip install nvidia-npp-cu12"),
    (dict(memlock=(64 << 10, 64 << 10), pinned_bytes=600 << 20), "pinned memory", WARN,
     "ulimit -l 64 KiB < the ring page-locks up to 600 MiB"),
    (dict(memlock=(1 << 30, 1 << 30), pinned_bytes=600 << 20), "pinned memory", OK, "ulimit -l 1 GiB"),
    # G5: Docker's 64 KiB is plenty for an image dataset's ring, not for NCCL over InfiniBand
    (dict(memlock=(64 << 10, 64 << 10), pinned_bytes=20 << 10, world_size=16), "pinned memory", WARN,
     "spans nodes (WORLD_SIZE=16 > LOCAL_WORLD_SIZE=8): NCCL over InfiniBand (RDMA) registers"),
    (dict(memlock=(64 << 10, 64 << 10), pinned_bytes=20 << 10, world_size=8), "pinned memory", OK,
     "a job across nodes needs ulimit -l unlimited"),
    (dict(memlock=(-1, -1), world_size=16), "pinned memory", OK, "ulimit -l unlimited"),
    # shards hold no file descriptor (mapped by fastload._C.map_file): more shards than
    # ulimit -n is fine; each is one memory mapping, bounded by vm.max_map_count
    (dict(nofile=(1024, 1024), shards=2000), "open files", OK, "2000 shard(s) are 2000 memory mapping(s)"),
    (dict(nofile=(32, 4096), shards=10), "open files", WARN, "too few for Python"),
    (dict(nofile=(32, 4096)), "open files", WARN, "raise it: ulimit -n 4096"),
    (dict(nofile=(32, -1)), "open files", WARN, "raise it: ulimit -n 4096"),
    (dict(nofile=(32, 1024)), "open files", WARN, "raise it to the hard limit: ulimit -n 1024"),
    (dict(nofile=(32, 48)), "open files", WARN, "ulimit -n 48 (the hard limit) is still too few: raise the hard"),
    (dict(nofile=(32, 32)), "open files", WARN, "the hard limit is 32 too, so ulimit -n cannot raise it"),
    (dict(nofile=(32, 32)), "open files", WARN, "docker run --ulimit nofile=4096:4096"),
    # more shards than that: at most a quarter of it (at most 4096) stay mapped at once
    (dict(nofile=(1024, 1024), shards=70_000, max_map_count=65530), "open files", OK,
     "of the dataset's 70000 shards at most 4096 are kept memory-mapped at once"),
    (dict(nofile=(1024, 1024), shards=70_000, max_map_count=6000), "open files", WARN,
     "up to 7096 mappings with 4096 for the process, more than vm.max_map_count 6000"),
    (dict(nofile=(1024, 1024), shards=2000, max_map_count=65530), "open files", OK, "vm.max_map_count 65530"),
    (dict(shm=(64 << 20, 64 << 20)), "/dev/shm", WARN, "--shm-size"),
    (dict(shm=None), "/dev/shm", WARN, "missing"),
    (dict(shm=(64 << 20, 64 << 20), local_world_size=1), "/dev/shm", OK, "does not use it"),
    (dict(cores=8), "threads", WARN, "one core per rank"),
    (dict(local_world_size=1, local_world_size_set=False, torch_gpus=8), "threads", WARN, "export LOCAL_WORLD_SIZE"),
    (dict(torch_threads=16), "torch threads", WARN, "OMP_NUM_THREADS=8"),
    # a CPU job on 2 cores with torch's default 2 threads: fastload's 1 gather + 2x2 DALI threads
    # yield to the loop at nice 19 (the policy; users tune nothing), so no warning
    (dict(device="cpu", cores=2, local_world_size=1, local_rank=None, torch_threads=2, gather_threads=1,
          dali_threads=4), "torch threads", OK, "run at nice 19, below the loop"),
    (dict(device="cpu", cores=2, local_world_size=1, local_rank=None, torch_threads=2, gather_threads=1,
          dali_threads=4, loader_nice=0), "torch threads", WARN, "(FASTLOAD_NICE=0), so the training step and"),
    (dict(device="cpu", cores=2, local_world_size=1, local_rank=None, torch_threads=1, gather_threads=1,
          dali_threads=2, loader_nice=0), "torch threads", OK, "(2 core(s) per rank)"),
    (dict(loader_nice_error="FASTLOAD_NICE='x': expected a nice value 0..19"), "torch threads", WARN,
     "FASTLOAD_NICE='x'"),
    (dict(dataset="/d", dataset_error="no manifest.json"), "dataset", FAIL, "/d: no manifest.json"),
])
def test_each_verdict(change, name, status, words):
    st, msg = verdicts(gpu_host(**change))[name]
    assert (st, words in msg) == (status, True), msg


def test_no_gpu_summary_only_for_cuda():
    no_gpu = dict(driver=None, driver_cuda=None, gpus=[], torch_gpus=0, torch_cuda=None)
    assert verdicts(gpu_host(**no_gpu))["summary"] == (WARN, NO_GPU_NOTE + "; the CUDA graphs were checked offline "
                                                        "(operators and placement) and their CPU twins built and run; "
                                                        "none was built on a GPU")
    v = verdicts(gpu_host(device="cpu", **no_gpu))
    assert "summary" not in v and v["gpu"] == (OK, "none needed (--device cpu)")
    assert v["pinned memory"][0] == OK and v["torch"] == (OK, "2.13.0+cu124")


def test_exit_status_is_1_on_any_fail(monkeypatch):
    monkeypatch.setattr(doctor, "gather", lambda *a: gpu_host(torch_gpus=0))
    out = io.StringIO()
    assert doctor.run("cuda", out=out) == 1
    assert "fail  gpu" in out.getvalue() and out.getvalue().rstrip().endswith("ok")
    monkeypatch.setattr(doctor, "gather", lambda *a: gpu_host())
    assert doctor.run("cuda", out=io.StringIO()) == 0


def test_graph_failures_are_reported(monkeypatch):
    from fastload.pipeline import offline

    def broken(t, device):
        raise RuntimeError('Argument "resize_xx" is not defined for operator "Resize".\nmore')

    monkeypatch.setattr(offline, "check", broken)
    checks = doctor.check_graphs("cuda", gpu_usable=False)
    assert {c.status for c in checks} == {FAIL} and len(checks) == len(doctor.presets())
    assert checks[0].message == 'DALI rejects the cuda graph: Argument "resize_xx" is not defined for operator "Resize".'


def _doctor(*args, preexec=None, env=None, module="fastload"):
    cmd = [sys.executable, "-m", module, *(["doctor"] if module == "fastload" else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=preexec, env=env)


@pytest.mark.skipif(doctor._nvml()[0] is not None, reason="an NVIDIA driver is present: this checks the no-GPU report")
def test_doctor_here_validates_cuda_graphs_offline_and_exits_0():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    r = _doctor("--device", "cuda", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    graphs = [ln for ln in lines if ln.split()[1:2] == ["graph"]]
    assert len(graphs) == len(doctor.presets())
    for ln in graphs:  # what was done, and what not
        assert ln.startswith("ok") and "checked offline: operators and placement (decoders." in ln, ln
        assert "@mixed" in ln and "CPU twin built and ran 2 JPEGs -> (2, " in ln, ln
        assert ln.endswith("not built on a GPU (no GPU)"), ln
    assert any(ln.startswith("warn") and NO_GPU_NOTE in ln for ln in lines)
    assert lines[-1].startswith("0 fail")


def test_doctor_knows_shards_hold_no_file_descriptor(tmp_path):
    path = tmp_path / "ds"
    with fastload.ShardWriter(path, {"x": "float32[64]"}, shard_size="4KB") as wr:
        wr.write_batch({"x": np.zeros((200, 64), np.float32)})
    shards = fastload.Dataset(path).num_shards
    assert shards > 10
    soft = doctor.FD_RESERVE + shards - 5  # fewer descriptors than shards + the process's: fine now
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    r = _doctor(str(path), "--device", "cpu", preexec=lower)
    assert r.returncode == 0, r.stdout + r.stderr
    line, = [ln for ln in r.stdout.splitlines() if "open files" in ln]
    assert line.startswith("ok") and f"ulimit -n {soft}" in line and f"{shards} shard(s)" in line, line
    assert "without keeping a file descriptor" in line
    assert f"dataset           {path}: 200 samples in {shards} shard(s)" in r.stdout


def test_graphs_are_built_and_run_on_the_gpu_when_there_is_one(monkeypatch):
    from fake_cuda import FakeCuda, fake_dali_on_gpu

    from fastload.pipeline import Runner

    fake = FakeCuda.install(monkeypatch, device_count=2)
    builds = fake_dali_on_gpu(fake, monkeypatch)
    checks = doctor.check_graphs("cuda", gpu_usable=True, device_id=1)
    assert len(builds) == len(checks) == len(doctor.presets())  # each preset's CUDA graph built once
    for c in checks:
        assert c.status == OK and c.message.startswith("checked offline: operators and placement (decoders.")
        assert "@mixed" in c.message and "CPU twin built and ran" in c.message
        assert c.message.endswith("; built and ran a JPEG on cuda:1")
    monkeypatch.setattr(Runner, "_canary_error", lambda self: "nvImageCodec failure")
    failed = doctor.check_graphs("cuda", gpu_usable=True, device_id=1)
    assert {c.status for c in failed} == {FAIL}
    assert all(c.message.endswith("; fails on a valid JPEG on cuda:1: nvImageCodec failure") for c in failed)


def test_the_module_runs_alone_and_bad_usage_exits_2():
    r = _doctor("--device", "cpu", "--batch-size", "0")
    assert r.returncode == 2 and r.stderr.strip() == "fastload doctor: error: --batch-size=0 must be >= 1"
    r = _doctor("--device", "tpu", module="fastload.doctor")
    assert r.returncode == 2 and "invalid choice: 'tpu'" in r.stderr


def test_the_ring_s_page_locked_bytes_follow_the_loader_s_prefetch(tmp_path):
    """``ulimit -l`` is compared with what the Loader page-locks: ring slots of the raw fields
    and the index, for prefetch + 2 slots; with image fields on CUDA the prefetch is at most
    3 (decoded images live on the device), not the host default of up to 8."""
    from fastload.doctor import probe
    from fastload.ring.size import default_prefetch

    with fastload.ShardWriter(tmp_path / "raw", {"x": "float32[64]"}) as wr:
        wr.write_batch({"x": np.zeros((10, 64), np.float32)})
    with fastload.ShardWriter(tmp_path / "img", {"image": "image", "label": "int64"}) as wr:
        wr.write({"image": b"\xff\xd8\xff", "label": 1}, key="a.jpg", image_sizes={"image": (8, 8)})
    f = Facts(device="cuda", dataset=str(tmp_path / "raw"), gather_threads=3)
    probe._dataset(f, 16)
    assert f.pinned_bytes == (default_prefetch(3, 16 * 264) + 2) * 16 * 264  # 64 floats + the int64 index
    f = Facts(device="cuda", dataset=str(tmp_path / "img"), gather_threads=3)
    probe._dataset(f, 16)
    assert f.pinned_bytes == 5 * 16 * 16  # the label and the index; 3 in flight + 2
