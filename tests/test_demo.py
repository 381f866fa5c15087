"""The README's first command runs `fastload demo`: it must work end to end."""
from __future__ import annotations

import json
import subprocess
import sys


def test_demo_quick(tmp_path):
    p = subprocess.run([sys.executable, "-m", "fastload", "demo", "--quick", "--out", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]", "fastload Loader", "DataLoader num_workers=0", "output:"):
        assert step in p.stdout, step
    r = json.loads((tmp_path / "demo" / "demo-results.json").read_text())
    assert r["images"] == 96 and all(x["samples_per_s"] > 0 for x in r["results"])
    assert (tmp_path / "demo" / "dataset" / "manifest.json").exists()
