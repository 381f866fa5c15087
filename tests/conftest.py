"""Shared pytest fixtures: every test must leave no thread behind.

``no_leaked_threads`` (autouse) snapshots the Python threads (``threading.enumerate()``) and
the native threads of the process (the entries of ``/proc/self/task``, which include C++
``std::thread``s that Python cannot see) before each test, and fails the test if new ones
are still alive a short grace period after it ended. Process-wide pools that libraries start
once and keep (torch's intra-op pool) are started by a session fixture before any snapshot.
Native threads that carry no name of their own (their name is the process's, e.g. "python")
are not counted: those are library pools that grow lazily with concurrent work (Arrow's CPU
and I/O pools start a second worker only when two tasks overlap, so "leaks" of them came and
went with timing). Every native thread fastload or DALI starts is named ("fastload-ring",
"[DALI]..."), and fastload's Python threads are tracked through ``threading.enumerate()``.
Once a test ran Ray in this process (its core worker links gRPC), gRPC's own threads
(``GRPC_THREADS``: its event engine, timers and executors) come and go for the process's life,
after ``ray.shutdown()`` too, so later tests do not count them (the test that first starts Ray
still does, unless marked).
Mark a test ``@pytest.mark.allow_thread_leak`` to opt out, and say why.

``loader_priority_as_shipped`` (autouse) unsets ``FASTLOAD_NICE`` for each test and puts it back.

``cpu_unless_marked_cuda`` (autouse) hides any GPU from tests not marked ``cuda``, so the
suite means the same on a GPU host as here; ``cuda`` tests run only where there is a GPU.

Fixtures several test files share (a file may define its own of the same name instead):
``fake`` (a fake ``torch.cuda`` with two GPUs, tests/fake_cuda.py, this process outside
torchrun) and ``image_ds`` (60 real photo crops as JPEG with labels, in several shards; one
per test module). Two plugins add theirs: tests/_remote.py (``moto``, ``proxy``, ``s3_env``,
``local_ds``, ``remote_url``: the servers of the remote-dataset tests) and tests/_convert.py
(``images``, ``reference``: one image folder and its conversion for the whole session).
Fixtures live in conftest.py or a plugin, never imported into a test module: an imported
fixture is a separate fixture per module (a session-scoped one would be made again in each).
tests/_ray.py shares one Ray cluster among the Ray tests; tests/_gc.py (no fixtures) collects and
freezes what survives each module's boundary, so the collector walks only the running module's
objects (a full collection over the session's heap cost ~0.2 s each).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest

pytest_plugins = ["_remote", "_convert", "_ray", "_gc"]

_GRACE_S = 2.0
# gRPC's process-lifetime threads, by their (truncated) names: seen starting seconds after ray.shutdown()
GRPC_THREADS = {"event_engine", "grpc_global_tim", "timer_manager", "default-executo", "resolver-execut"}
_TASK_DIR = "/proc/self/task"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_thread_leak(reason): the test may leave threads running (say why)"
    )


def _process_name() -> str | None:
    try:
        with open("/proc/self/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _native_threads() -> dict[str, str] | None:
    """{tid: thread name} of this process's *named* threads, or None where /proc is
    unavailable (unnamed ones: see the module docstring)."""
    try:
        tids = os.listdir(_TASK_DIR)
    except OSError:
        return None
    unnamed = _process_name()
    out = {}
    for tid in tids:
        try:
            with open(f"{_TASK_DIR}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # exited meanwhile
            continue
        if name != unnamed:
            out[tid] = name
    return out


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """fastload's node-local cache (the verified-shard record) in a temporary directory, not
    the user's ~/.cache (subprocesses the tests start inherit it)."""
    old = os.environ.get("FASTLOAD_CACHE")
    os.environ["FASTLOAD_CACHE"] = str(tmp_path_factory.mktemp("fastload-cache"))
    yield
    if old is None:
        os.environ.pop("FASTLOAD_CACHE", None)
    else:
        os.environ["FASTLOAD_CACHE"] = old


@pytest.fixture(scope="session", autouse=True)
def _start_process_wide_pools(request: pytest.FixtureRequest) -> None:
    """Start the thread pools libraries create lazily and keep for the process's life, so
    that the first test to trigger them is not blamed for a leak."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    x = torch.ones(1 << 20)
    (x + 1).sum().item()
    torch.from_numpy(x.numpy()).mul_(2).sum().item()
    # Arrow's CPU thread pool starts on the first IPC read; skimage.data starts a loader
    # thread on first use. Both live for the process.
    import tempfile

    import pyarrow as pa
    with tempfile.TemporaryDirectory() as d:
        t = pa.table({"a": [1, 2, 3]})
        with pa.OSFile(f"{d}/x.arrow", "wb") as f, pa.ipc.new_file(f, t.schema) as w:
            w.write_table(t)
        with pa.memory_map(f"{d}/x.arrow") as m:
            pa.ipc.open_file(m).get_batch(0)
        # ... and its I/O pool on the first Parquet / CSV / JSON read.
        import pyarrow.csv
        import pyarrow.json
        import pyarrow.parquet as pq
        pq.write_table(t, f"{d}/x.parquet")
        pq.read_table(f"{d}/x.parquet")
        with open(f"{d}/x.csv", "w") as f:
            f.write("a,b\n1,2\n")
        pyarrow.csv.read_csv(f"{d}/x.csv")
        with open(f"{d}/x.jsonl", "w") as f:
            f.write('{"a": 1}\n')
        pyarrow.json.read_json(f"{d}/x.jsonl")
    try:
        import skimage.data
        skimage.data.camera()
    except ImportError:  # pragma: no cover
        pass
    cuda_tests = any(item.get_closest_marker("cuda") is not None for item in request.session.items)
    if cuda_tests and torch.cuda.is_available():  # pragma: no cover - no GPU on the CI machine
        start_gpu_threads()


def start_gpu_threads() -> list:
    """On a GPU host the first CUDA context starts the driver's own process-lifetime threads
    ("cuda-EvtHandlr", "cuda0000..."), and the first mixed DALI pipeline on a device may
    start those of the GPU image decoders' libraries (nvImageCodec/nvJPEG, the hardware JPEG
    decoder, NPP): start them all, on every visible device, before any test counts threads,
    so that the first `cuda` test is not blamed for them (only when a test marked `cuda` is
    collected: other tests see no GPU). The pipelines are the doctor's canary, one per
    decoder the presets use (ROI and whole-image), built and run on a JPEG on each device,
    then closed. Returns the canary's verdicts (failures are the `cuda` tests' to report)."""
    import importlib.util

    import torch

    for d in range(torch.cuda.device_count()):
        torch.empty(1, device=torch.device("cuda", d)).add_(1)
        torch.cuda.synchronize(d)
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return []
    from fastload.doctor import check_graphs

    return [c for d in range(torch.cuda.device_count()) for c in check_graphs("cuda", True, d, ["train", "eval"])]


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process and the processes it starts see no GPU: ``torch.cuda.is_available()``
    is False (so ``Loader(device=None)`` picks the CPU) and ``CUDA_VISIBLE_DEVICES`` is
    empty for subprocesses (examples, torchrun ranks)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Tests not marked ``cuda`` run as on a machine without a GPU, whatever the machine:
    they read batches on the host (``.numpy()``), and on a GPU host ``device=None`` would
    otherwise deliver them on the GPU. Fake-CUDA tests install their fake over this."""
    if request.node.get_closest_marker("cuda") is None:
        hide_cuda(monkeypatch)
    yield


@pytest.fixture(autouse=True)
def loader_priority_as_shipped(monkeypatch: pytest.MonkeyPatch):
    """Every test starts with fastload's own thread priority (``FASTLOAD_NICE`` unset) and
    leaves the environment as it found it: a benchmark's ``main()`` called in-process sets
    ``FASTLOAD_NICE=0`` (fastload.bench.machine.equal_priority), which would otherwise run the
    tests after it at the training loop's priority."""
    monkeypatch.delenv("FASTLOAD_NICE", raising=False)
    yield


@pytest.fixture(autouse=True)
def no_leaked_threads(request: pytest.FixtureRequest):
    if request.node.get_closest_marker("allow_thread_leak") is not None:
        yield
        return
    py_before = set(threading.enumerate())
    native_before = _native_threads()
    grpc_pool = "ray._raylet" in sys.modules  # (see the module docstring)
    yield
    deadline = time.monotonic() + _GRACE_S
    while True:
        py_new = [t for t in threading.enumerate() if t not in py_before and t.is_alive()]
        native_now = _native_threads()
        native_new = (
            {} if native_before is None or native_now is None
            else {tid: name for tid, name in native_now.items()
                  if tid not in native_before and not (grpc_pool and name in GRPC_THREADS)}
        )
        if not py_new and not native_new:
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    parts = []
    if py_new:
        parts.append("Python threads: " + ", ".join(repr(t.name) for t in py_new))
    if native_new:
        parts.append("native threads (tid:name): " + ", ".join(f"{k}:{v}" for k, v in sorted(native_new.items())))
    pytest.fail(
        f"test left {len(py_new)} Python and {len(native_new)} native thread(s) running "
        f"{_GRACE_S}s after it ended — close()/join what it started. " + "; ".join(parts),
        pytrace=False,
    )


# -- fixtures several test files share ---------------------------------------------------------
@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    """A fake torch.cuda with two GPUs (tests/fake_cuda.py), this process outside torchrun."""
    from fake_cuda import FakeCuda

    return FakeCuda.install(monkeypatch, device_count=2, outside_torchrun=True)


@pytest.fixture(scope="module")
def image_ds(tmp_path_factory: pytest.TempPathFactory):
    """60 real photo crops (JPEG) of 80-199 px with labels ``i % 4``, in several shards (200KB)."""
    import fastload
    from _images import write_photo_crops

    return fastload.Dataset(write_photo_crops(tmp_path_factory.mktemp("img") / "ds", 60, "200KB"))
