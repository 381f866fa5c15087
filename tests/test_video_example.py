"""examples/train_video.py runs in a shortened form, so it cannot rot (issue 29)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from _zygote import run_python

pytest.importorskip("av")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_train_video_learns_the_direction_of_motion(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = run_python(ROOT / "examples" / "train_video.py", "--data", tmp_path, "--make-data", "64", "--epochs", "6",
                   timeout=300, env=env, cwd=tmp_path)  # forked from the tests' launcher (tests/_zygote.py)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "converted 64 videos into 1 shard(s)" in p.stdout
    epochs = [ln for ln in p.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(epochs) == 6
    first, last = (float(e.split("loss ")[1].split(",")[0]) for e in (epochs[0], epochs[-1]))
    assert last < 0.8 * first, epochs  # it learns: the drift's direction is in the motion
