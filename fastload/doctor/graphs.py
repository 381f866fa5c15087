"""The preset DALI graphs, each line saying what was done with it:

1. *checked offline*: DALI's schema and device checks of the graph for the device and where
   each operator runs (``fastload.pipeline.offline.check``; builds no operator);
2. *CPU twin built and ran*: the same operators with the same arguments, the whole graph in
   DALI on the CPU, built and run on a batch of valid JPEGs, the output compared with the
   transform's declared shape and dtype (``offline.run_twin``: argument values, types and
   layouts, the output shape);
3. on the CPU or a usable GPU, the graph itself built and run on a valid JPEG on the device;
   without a GPU, ``not built on a GPU (no GPU)``.
"""
from __future__ import annotations

from typing import Any

from .facts import FAIL, OK, Check, _first_line

NOT_BUILT = "not built on a GPU (no GPU)"


def presets() -> dict[str, Any]:
    from .. import vision

    return {"train": vision.train(224), "train-uint8": vision.train(224, dtype="uint8", layout="HWC"),
            "eval": vision.eval(224), "eval-fp16": vision.eval(224, dtype="float16")}


def check_graphs(device: str, gpu_usable: bool, device_id: int | None = None,
                 names: list[str] | None = None) -> list[Check]:
    """One check per preset (or those ``names``): see the module docstring."""
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
        done = [f"checked offline: operators and placement ({report.summary()})"]
        try:
            twin = offline.run_twin(t)
        except RuntimeError as e:
            out.append(Check(FAIL, label, f"{done[0]}; {_first_line(e)}"))
            continue
        done.append(f"CPU twin built and ran {twin.summary()}")
        if device == "cuda" and not gpu_usable:
            out.append(Check(OK, label, "; ".join([*done, NOT_BUILT])))
            continue
        runner = t.runner(device=device, batch_size=2, num_threads=1, device_id=device_id)
        try:
            err = runner._canary_error()
        finally:
            runner.close()
        on = f"cuda:{device_id}" if device == "cuda" else "the CPU"
        if err is not None:
            out.append(Check(FAIL, label, f"{'; '.join(done)}; fails on a valid JPEG on {on}: {err}"))
        else:
            out.append(Check(OK, label, "; ".join([*done, f"built and ran a JPEG on {on}"])))
    return out
