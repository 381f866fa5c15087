"""The README's first command runs `fastload demo`: it must work end to end."""
from __future__ import annotations

import json

from _zygote import run_python


def test_demo_quick(tmp_path):
    p = run_python("-m", "fastload", "demo", "--quick", "--out", tmp_path / "demo", timeout=600)  # (tests/_zygote.py)
    assert p.returncode == 0, p.stderr[-3000:]
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "fastload Loader", "DataLoader num_workers=0", "output:"):
        assert step in p.stdout, step
    r = json.loads((tmp_path / "demo" / "demo-results.json").read_text())
    assert r["images"] == 96 and all(x["samples_per_s"] > 0 for x in r["results"])
    assert (tmp_path / "demo" / "dataset" / "manifest.json").exists()
