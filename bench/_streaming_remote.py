"""MosaicML Streaming beside fastload in bench_remote.py: run in Streaming's own venv.

Streaming pins numpy<2.2 and imports torchvision, so it cannot share fastload's venv;
``bench_remote.py --streaming-venv DIR`` runs this script with ``DIR/bin/python`` (make the
venv with ``--make-streaming-venv``). It imports nothing of fastload.

    write DIR ROWS DIM SHARD_BYTES       MDS shards of the bench's samples (the same values:
                                         numpy's default_rng(0), 4096 rows at a time)
    read REMOTE LOCAL BATCH STEP_MS LIMIT  one epoch through StreamingDataset + DataLoader;
                                         prints one JSON line (first_s, steady, samples)

The S3 endpoint and credentials come from the environment (S3_ENDPOINT_URL, AWS_*).
"""
from __future__ import annotations

import importlib
import json
import sys
import time
import types


def _import_streaming():
    try:
        return importlib.import_module("streaming")
    except (ImportError, RuntimeError) as e:
        # Streaming imports torchvision only for its vision datasets (not used here); a
        # torchvision whose build does not match the installed torch fails to import.
        if "torchvision" not in repr(e) and "nms" not in repr(e):
            raise
        for name in list(sys.modules):
            if name == "torchvision" or name.startswith(("torchvision.", "streaming")):
                del sys.modules[name]
        tv = types.ModuleType("torchvision")
        tv.datasets = types.ModuleType("torchvision.datasets")
        tv.datasets.VisionDataset = type("VisionDataset", (), {})
        tv.datasets.CIFAR10 = type("CIFAR10", (), {})
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
        tv.transforms.functional.to_tensor = lambda x: x
        sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                            "torchvision.transforms": tv.transforms,
                            "torchvision.transforms.functional": tv.transforms.functional})
    return importlib.import_module("streaming")


def write(out: str, rows: int, dim: int, shard_bytes: int) -> None:
    import numpy as np

    streaming = _import_streaming()
    rng = np.random.default_rng(0)
    with streaming.MDSWriter(out=out, columns={"x": f"ndarray:float32:{dim}", "y": "int64"},
                             size_limit=shard_bytes) as w:
        for s in range(0, rows, 4096):
            k = min(4096, rows - s)
            x = rng.standard_normal((k, dim)).astype(np.float32)
            for i in range(k):
                w.write({"x": x[i], "y": s + i})


def read(remote: str, local: str, batch: int, step_ms: float, limit: str) -> None:
    import torch.utils.data as tud

    streaming = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # a previous run's shared memory would mislead this one
    t0 = time.perf_counter()
    ds = streaming.StreamingDataset(remote=remote, local=local, batch_size=batch, shuffle=True, shuffle_algo="py1s",
                                    num_canonical_nodes=1, cache_limit=None if limit == "none" else limit,
                                    download_timeout=120)
    loader = tud.DataLoader(ds, batch_size=batch, num_workers=2, persistent_workers=False)
    n = n0 = 0
    t_first = None
    for b in loader:
        if t_first is None:
            t_first = time.perf_counter()
            n0 = len(b["y"])
        n += len(b["y"])
        if step_ms:
            time.sleep(step_ms / 1e3)
    t_end = time.perf_counter()
    steady = (n - n0) / (t_end - t_first) if t_first is not None and t_end > t_first else float("nan")
    print(json.dumps({"first_s": (t_first or t_end) - t0, "steady": steady, "samples": n}), flush=True)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "write":
        write(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif cmd == "read":
        read(args[0], args[1], int(args[2]), float(args[3]), args[4])
    else:
        raise SystemExit(__doc__)
