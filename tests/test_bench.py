"""`fastload bench` (JSON and PNG outputs checked) and the bench/ scripts at smoke size."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fastload
from fastload.sample_data import make_image_folder

ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def image_ds(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    make_image_folder(d / "src", 40, seed=0, min_side=96, max_side=160)
    fastload.convert("imagefolder", d / "src", d / "ds", progress=False)
    return d / "ds"


def test_bench_images_compare_limit_json_png(image_ds, tmp_path):
    p = run("-m", "fastload", "bench", image_ds, "--batch-size", "8", "--compare", "torch", "--workers", "0",
            "--limit", "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "DataLoader num_workers=0" in p.stdout and "vs DataLoader" in p.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert {"title", "machine", "dataset", "settings", "results", "not_measured"} <= set(r)
    assert {"cpu", "cores", "memory_gib", "gpu", "versions"} <= set(r["machine"])
    assert r["machine"]["versions"]["dali"] and r["dataset"]["samples"] == 40
    kinds = [x["kind"] for x in r["results"]]
    assert kinds == ["ours", "dataloader", "limit"]
    for x in r["results"]:
        assert x["samples"] > 0 and x["seconds"] > 0 and x["samples_per_s"] > 0 and x["mb_per_s"] > 0
    ours = r["results"][0]
    assert ours["samples"] == 40 and 0 <= ours["wait_fraction"] <= 1 and ours["first_batch_s"] > 0
    assert ours["stages"]["decode_s"] > 0
    if not r["machine"]["gpu"]:
        assert any("GPU" in s for s in r["not_measured"]) and "not measured" in p.stdout
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(tmp_path / "r.png") as im:
        im.verify()
        assert im.size[0] > 400 and im.size[1] > 200


def test_bench_raw_fields_without_compare(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[784]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.zeros((3000, 784), np.float32), "label": np.arange(3000) % 10})
    p = run("-m", "fastload", "bench", tmp_path / "ds", "--batch-size", "300", "--epochs", "2", "--limit",
            "--world-size", "2", "--json", tmp_path / "r.json", "--no-progress")
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert [x["system"] for x in r["results"]] == ["fastload Loader", "memcpy of the same bytes"]
    assert r["results"][0]["samples"] == 2 * 1500  # rank 0 of 2, two epochs
    assert r["results"][0]["nbytes"] == 3000 * (784 * 4 + 8 + 8)


def test_bench_bad_arguments(image_ds, tmp_path):
    p = run("-m", "fastload", "bench", image_ds, "--batch-size", "0")
    assert p.returncode == 1 and "--batch-size=0" in p.stderr
    p = run("-m", "fastload", "bench", tmp_path / "missing")
    assert p.returncode == 1 and "missing" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--plot", tmp_path / "nodir" / "x.png")
    assert p.returncode == 1 and "does not exist" in p.stderr


def test_bench_scripts_smoke(tmp_path):
    """Every bench/ script at a tiny size, through the one entry point, so none can rot; each
    records a headline (fastload beside its baseline/limit) and the results table is made
    from those records."""
    res, md = tmp_path / "results.json", tmp_path / "results.md"
    p = run(ROOT / "bench" / "run_all.py", "--smoke", "--results", res, "--markdown", md, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    assert len(scripts) >= 6
    for s in scripts:
        assert f"{s.name}: exit 0" in p.stdout
    records = json.loads(res.read_text())
    assert {r["script"] for r in records} == {s.name for s in scripts}
    for r in records:
        assert r["smoke"] is True and r["machine"] and r["unit"]
        assert r["baseline"] is not None or r["limit"] is not None, r
        for pair in (r["baseline"], r["limit"]):
            assert pair is None or pair[1] > 0, r
        assert r["ours"][1] > 0 or r["lower_is_better"], r
    table = md.read_text().strip().splitlines()
    assert table[0].startswith("| workload") and len(table) == 2 + len(records)
    for r, line in zip(records, table[2:]):
        assert f"`python bench/{r['script']}`" in line and line.count("|") == 7


def test_readme_table_is_replaced_between_markers(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{run_all.BEGIN}\nold table\n{run_all.END}\nafter\n")
    rec = {"workload": "w", "script": "bench_open.py", "unit": "ms", "lower_is_better": True,
           "ours": ["a", 2.0], "baseline": ["b", 10.0], "limit": None, "note": "", "machine": "m"}
    table = run_all.markdown_table([rec])
    run_all.update_readme([rec], table, ["open"], readme=readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\nbefore\n") and text.endswith("after\n")
    assert "| w (`python bench/bench_open.py`) | a: 2.00 ms | b: 10.00 ms | – | 5.0x | – |" in text
    assert "--readme --only open" in text and "on: m." in text
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="expected one"):
        run_all.update_readme([rec], table, ["open"], readme=readme)
    assert readme.read_text() == "no markers"


def test_run_all_refuses_smoke_figures_in_readme():
    p = run(ROOT / "bench" / "run_all.py", "--smoke", "--readme", "--only", "open")
    assert p.returncode == 2 and "--readme publishes figures" in p.stderr
