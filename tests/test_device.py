"""fastload.runtime.device: which GPU a Loader uses (review test J, F11), the per-thread rules, the
CUDA error a handled failure leaves behind (F7); fastload.runtime.system: threads per rank (F6)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fake_cuda import ERROR_MEMORY_ALLOCATION, FakeCuda
from fastload.runtime import device as D
from fastload.runtime import system


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda.install(monkeypatch, device_count=4, outside_torchrun=True)


def _torchrun(monkeypatch, rank: int, local_world_size: int):
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))


def test_single_process_uses_the_current_device(fake):
    assert D.resolve_device(None) == torch.device("cuda", 0)
    torch.cuda.set_device(2)
    assert D.resolve_device(None) == D.resolve_device("cuda") == torch.device("cuda", 2)


def test_one_gpu_per_local_rank_uses_local_rank(fake, monkeypatch):
    _torchrun(monkeypatch, 3, 4)
    assert D.resolve_device(None) == torch.device("cuda", 3)
    torch.cuda.set_device(0)  # even after the script touched cuda:0: LOCAL_WORLD_SIZE == device_count
    assert D.resolve_device("cuda") == torch.device("cuda", 3)


def test_a_rank_that_chose_cuda_0_on_purpose_keeps_it(fake, monkeypatch):
    """Two GPUs per rank: rank 1 owns cuda:2,3 but the launcher remapped them, and the
    script put its model on cuda:0 (F11): batches must go there, not to cuda:LOCAL_RANK."""
    _torchrun(monkeypatch, 1, 2)
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the model: CUDA is in use
    assert D.resolve_device(None) == torch.device("cuda", 0)


def test_local_rank_before_any_cuda_use(fake, monkeypatch):
    _torchrun(monkeypatch, 1, 2)  # 2 ranks on 4 GPUs; the script has not used CUDA yet
    assert not torch.cuda.is_initialized()
    assert D.resolve_device(None) == torch.device("cuda", 1)
    assert not torch.cuda.is_initialized()  # resolving asked nothing that initialises CUDA
    monkeypatch.setenv("LOCAL_RANK", "6")  # more ranks than GPUs: wrap
    assert D.resolve_device(None) == torch.device("cuda", 2)


def test_a_script_that_only_asked_for_the_current_device_has_used_cuda(fake, monkeypatch):
    """torch.cuda.current_device() initialises CUDA: from then on cuda:0 may be the script's
    choice, and 2 ranks on 4 GPUs keep it rather than guess LOCAL_RANK."""
    _torchrun(monkeypatch, 1, 2)
    assert torch.cuda.current_device() == 0 and torch.cuda.is_initialized()
    assert D.resolve_device(None) == torch.device("cuda", 0)


def test_explicit_devices_win_and_bad_ones_are_named(fake, monkeypatch):
    _torchrun(monkeypatch, 3, 4)
    assert D.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert D.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="sees 4 CUDA device"):
        D.resolve_device("cuda:7")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        D.resolve_device("meta")


def test_select_is_per_thread_and_guard_restores(fake):
    seen = {}

    def worker():
        D.select(torch.device("cuda", 2))
        seen["worker"] = torch.cuda.current_device()

    t = threading.Thread(target=worker, name="w")
    t.start()
    t.join()
    assert seen["worker"] == 2 and torch.cuda.current_device() == 0
    with D.guard(torch.device("cuda", 3)):
        assert torch.cuda.current_device() == 3
    assert torch.cuda.current_device() == 0


def test_clear_cuda_error_reads_the_last_error_away(fake):
    buf = np.zeros(4096, np.uint8)
    fake.register_error = ERROR_MEMORY_ALLOCATION
    torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 1)
    assert D.clear_cuda_error() == ERROR_MEMORY_ALLOCATION
    assert D.clear_cuda_error() == 0
    fake.launch_kernel()  # nothing left to raise


def test_the_runtime_torch_links_is_found_in_the_process_maps():
    maps = ("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/"
            "libcudart.so.12\n7f40-7f50 rw-p 00000000 00:00 0 \n")
    assert D.libcudart_path(maps) == "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    assert D.libcudart_path("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n") is None


@pytest.mark.parametrize("cores, lws, gather, dali_cpu, dali_gpu", [
    (2, None, 1, 2, 2),
    (64, None, 7, 64, 4),
    (64, "8", 7, 8, 4),
    (16, "8", 1, 2, 2),
    (4, "8", 1, 1, 1),
    (16, "x", 7, 16, 4),  # malformed: one rank
])
def test_threads_are_sized_per_local_rank(monkeypatch, cores, lws, gather, dali_cpu, dali_gpu):
    from fastload.ring.size import default_gather_threads
    from fastload.pipeline import default_threads

    monkeypatch.setattr(system, "usable_cores", lambda: cores)
    if lws is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", lws)
    assert (default_gather_threads(), default_threads("cpu"), default_threads("cuda")) == (gather, dali_cpu, dali_gpu)


def test_tests_not_marked_cuda_see_no_gpu(monkeypatch, tmp_path):
    """Review test E (F1): the conftest hides a GPU from tests not marked `cuda`, so their
    Loaders deliver on the host even on a GPU machine (here: the fake one)."""
    import os

    import fastload
    from conftest import hide_cuda

    # the autouse fixture has already done it for this very test (not marked cuda) ...
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0
    # ... and what it does works on a GPU host: shown on the fake one
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[2]"}) as wr:
        wr.write_batch({"x": np.zeros((4, 2), np.float32)})
    FakeCuda.install(monkeypatch, device_count=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert fastload.Loader(tmp_path / "ds", batch_size=2).device == torch.device("cuda", 0)  # a GPU host
    hide_cuda(monkeypatch)
    with fastload.Loader(tmp_path / "ds", batch_size=2) as lo:
        assert lo.device == torch.device("cpu")
        assert next(iter(lo))["x"].numpy().shape == (2, 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # and subprocesses see none


def test_the_session_starts_every_gpu_s_decoder_threads(monkeypatch):
    """conftest.start_gpu_threads (run once per session on a GPU host, before any thread is
    counted): a context and a mixed DALI pipeline per decoder, run on a JPEG, on each GPU."""
    from conftest import start_gpu_threads
    from fake_cuda import fake_dali_on_gpu

    from fastload.pipeline import Runner

    fake = FakeCuda.install(monkeypatch, device_count=3)
    fake_dali_on_gpu(fake, monkeypatch)
    ran = []
    canary = Runner._canary_error
    monkeypatch.setattr(Runner, "_canary_error", lambda self: (ran.append(self.device_id), canary(self))[1])
    checks = start_gpu_threads()
    assert [c.status for c in checks] == ["ok"] * 6, [c.message for c in checks]
    assert [c.name for c in checks] == ["graph train", "graph eval"] * 3  # the ROI and the whole-image decoder
    assert all("@mixed" in c.message for c in checks)
    assert sorted(ran) == [0, 0, 1, 1, 2, 2]
    assert fake.contexts == {0, 1, 2}
