"""The preset DALI graphs: each validated offline for the device and, on the CPU or a usable
GPU, built and run on a valid JPEG."""
from __future__ import annotations

from typing import Any

from .facts import FAIL, OK, Check, _first_line


def presets() -> dict[str, Any]:
    from .. import vision

    return {"train": vision.train(224), "train-uint8": vision.train(224, dtype="uint8", layout="HWC"),
            "eval": vision.eval(224), "eval-fp16": vision.eval(224, dtype="float16")}


def check_graphs(device: str, gpu_usable: bool, device_id: int | None = None,
                 names: list[str] | None = None) -> list[Check]:
    """Each preset's graph (or those ``names``): validated offline for ``device`` (DALI's
    checks, operator placement) and, on the CPU or a usable GPU, built and run on a valid
    JPEG."""
    from ..pipeline import offline

    out = []
    for name, t in presets().items():
        if names is not None and name not in names:
            continue
        label = f"graph {name}"
        try:
            report = offline.check(t, device=device)
        except Exception as e:  # DALI refused the graph
            out.append(Check(FAIL, label, f"DALI rejects the {device} graph: {_first_line(e)}"))
            continue
        problems = report.problems()
        if problems:
            out.append(Check(FAIL, label, "; ".join(problems)))
            continue
        where = report.summary()
        if device == "cuda" and not gpu_usable:
            out.append(Check(OK, label, f"CUDA graph valid (offline): {where}"))
            continue
        runner = t.runner(device=device, batch_size=2, num_threads=1, device_id=device_id)
        try:
            err = runner._canary_error()
        finally:
            runner.close()
        on = f"cuda:{device_id}" if device == "cuda" else "the CPU"
        if err is not None:
            out.append(Check(FAIL, label, f"fails on a valid JPEG on {on}: {err}"))
        else:
            out.append(Check(OK, label, f"built and ran a JPEG on {on}: {where}"))
    return out
