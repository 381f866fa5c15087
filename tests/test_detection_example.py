"""examples/train_detection.py, shortened: it generates a dataset, trains the tiny detector on
vision.detection batches and its loss falls."""
from __future__ import annotations

import re

from test_examples import ROOT, run


def test_train_detection_runs_and_learns(tmp_path):
    out = run(ROOT / "examples" / "train_detection.py", "--data", tmp_path / "ds", "--make-data", "48",
              "--steps", "16", "--batch-size", "8", "--size", "64", cwd=tmp_path)
    assert re.search(r"batch: image \(8, 3, 64, 64\), boxes \(8, \d+, 4\)", out), out
    m = re.search(r"loss ([\d.]+) -> ([\d.]+) \(smoothed\) after 16 steps", out)
    assert m and float(m.group(2)) < float(m.group(1)), out
