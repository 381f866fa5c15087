"""``fastload doctor`` on a machine without a GPU: without ``--device`` it checks the device
``Loader(device=None)`` would use (the CPU path here), and ``--device cuda`` says plainly
that there is no GPU and that a CUDA job cannot run."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from fastload import doctor
from fastload.doctor import NO_GPU_NOTE, OK, WARN, Facts


def host(**kw) -> Facts:
    base = dict(torch_version="2.13.0+cpu", torch_cuda=None, torch_gpus=0, dali_version="2.4.0", dali_cuda_major=12,
                memlock=(8 << 20, 8 << 20), nofile=(20000, 20000), shm=(1 << 30, 1 << 30), cores=2,
                torch_threads=2, gather_threads=1, dali_threads=4)
    base.update(kw)
    return Facts(**base)


def verdicts(f: Facts) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.message) for c in doctor.assess(f)}


def test_chosen_cpu_without_a_gpu_is_ok_and_says_it_checks_the_cpu_path():
    v = verdicts(host(device="cpu", device_chosen=True))
    assert v["gpu"][0] == OK and v["gpu"][1].startswith("no GPU on this machine: checking the CPU path")
    assert "--device cuda" in v["gpu"][1]
    assert "summary" not in v and v["pinned memory"] == (OK, "not used with --device cpu")


def test_chosen_cpu_with_gpus_torch_cannot_use_warns_what_to_do():
    v = verdicts(host(device="cpu", device_chosen=True, driver="550.54.15", gpus=["NVIDIA A10"]))
    assert v["gpu"][0] == WARN
    assert "driver sees 1 GPU(s)" in v["gpu"][1] and "CPU-only build" in v["gpu"][1]
    assert "--device cuda" in v["gpu"][1]


def test_device_cuda_without_a_gpu_says_plainly_a_cuda_job_cannot_run():
    v = verdicts(host(device="cuda", driver_error="libnvidia-ml.so.1 not found"))
    status, msg = v["gpu"]
    assert status == WARN and msg.startswith("no GPU on this machine")
    assert "device='cuda' cannot run here" in msg and "libnvidia-ml.so.1 not found" in msg and NO_GPU_NOTE in msg


def test_run_without_device_asks_gather_to_choose_and_prints_the_choice(monkeypatch):
    asked = []

    def fake_gather(device, dataset, batch_size):
        asked.append(device)
        return host(device="cpu", device_chosen=True)

    monkeypatch.setattr(doctor, "gather", fake_gather)
    out = io.StringIO()
    assert doctor.run(out=out) == 0
    assert asked == [None]
    first = out.getvalue().splitlines()[0]
    assert first.startswith("fastload doctor: --device cpu (no --device and no usable GPU")


def _doctor(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no usable GPU, whatever the machine has
    return subprocess.run([sys.executable, "-m", "fastload", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_doctor_without_device_on_a_machine_without_gpu_checks_the_cpu_path():
    r = _doctor()
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("fastload doctor: --device cpu (no --device and no usable GPU")
    graphs = [ln for ln in lines if ln.split()[1:2] == ["graph"]]
    assert len(graphs) == len(doctor.presets())
    assert all(ln.startswith("ok") and "ran a JPEG on the CPU" in ln and "@mixed" not in ln for ln in graphs), graphs
    assert not any(NO_GPU_NOTE in ln for ln in lines)  # nothing was meant to run on a GPU
    assert lines[-1].startswith("0 fail")
