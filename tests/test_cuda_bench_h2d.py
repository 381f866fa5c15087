"""bench/bench_tensor.py --device cuda against the fake CUDA: every row runs, on the same bytes,
and the summary compares fastload's copy with torch's pinned copy (and cudaMemcpyAsync where
the runtime is reachable). The numbers themselves mean nothing here (tools/gpu_check.sh runs
it on a GPU)."""
from __future__ import annotations

import importlib.util
import os

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "bench_tensor.py")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tensor_h2d", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_h2d_case_runs_every_row_on_the_same_bytes(fake, monkeypatch, capsys):
    from fastload.runtime import device as D

    monkeypatch.setattr(D, "_torch_cudart", lambda: None)  # no cudaMemcpyAsync in the fake runtime
    bench = _bench()
    assert bench.main(["--device", "cuda", "--smoke", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "fastload copy: registered slot" in out and "torch pinned copy" in out and "pageable copy" in out
    assert "Large samples: Loader" in out and "of torch's pinned copy" in out
    assert fake.registered == {}  # the registered buffer was unregistered
    copies = [c for c in fake.copies if c.src == "cpu" and c.nbytes == 64 * 3 * 224 * 224]
    assert {c.src_pinned for c in copies} == {True, False}  # pinned rows and the pageable one


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _bench().main(["--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_h2d_case_on_a_gpu(capsys):  # pragma: no cover - needs a GPU
    assert _bench().main(["--device", "cuda", "--smoke", "--repeats", "1"]) == 0
    assert "of cudaMemcpyAsync" in capsys.readouterr().out
