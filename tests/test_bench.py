"""`fastload bench` (JSON and PNG outputs checked), its DataLoader baseline (the same work as
the Loader), the shared report module, and the bench/ scripts at smoke size."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import fastload
from _zygote import run_python
from fastload.demo.photos import make_image_folder

ROOT = Path(__file__).resolve().parent.parent


def run(*args, timeout=600):
    """``python *args``, forked from the tests' process launcher (tests/_zygote.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return run_python(*args, timeout=timeout, env=env, cwd=ROOT)


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
    rates = r["results"][0]["round_rates"]  # each epoch's samples/s: the figure's spread
    assert len(rates) == 2 and min(rates) <= r["results"][0]["samples_per_s"] <= max(rates)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("fastload Loader"))
    assert f"({min(rates):,.0f}–{max(rates):,.0f})" in line
    assert r["results"][0]["nbytes"] == 3000 * (784 * 4 + 8 + 8)


def test_bench_step_trains_a_real_model_beside_each_loader(tmp_path):
    """--step mlp: every system's batches go through a real forward + backward + SGD step (the
    warm-up batches' too), counted in the JSON; the text report says so."""
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[784]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.random.default_rng(0).random((1200, 784), np.float32), "label": np.arange(1200) % 10})
    p = run("-m", "fastload", "bench", tmp_path / "ds", "--batch-size", "100", "--step", "mlp", "--compare", "torch",
            "--workers", "0", "--warmup", "2", "--json", tmp_path / "r.json", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "training step: mlp (14 forward + backward + SGD steps, real)" in p.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["settings"]["step"] == "mlp" and r["settings"]["step_ms"] == 0
    assert [(x["system"], x["extra"]["steps"]) for x in r["results"]] == [("fastload Loader", 14),
                                                                         ("DataLoader num_workers=0", 14)]
    p = run("-m", "fastload", "bench", tmp_path / "ds", "--step", "cnn")
    assert p.returncode == 1 and "--step cnn trains a CNN on images" in p.stderr and "no image field" in p.stderr
    p = run("-m", "fastload", "bench", tmp_path / "ds", "--step", "mlp", "--step-ms", "3")
    assert p.returncode == 1 and "--step mlp and --step-ms 3: choose one" in p.stderr


def test_model_step_is_a_real_sgd_step_on_the_batch():
    import torch

    from fastload.bench.models import ModelStep

    step = ModelStep("mlp", classes=10)
    batch = {"x": torch.rand(8, 784), "label": torch.arange(8) + 20, "index": torch.arange(8)}
    step(batch)
    w0 = step.model[0].weight.detach().clone()
    assert step.model[0].in_features == 784 and step.model[2].out_features == 10
    step(batch)
    assert step.calls == 2 and not torch.equal(w0, step.model[0].weight)  # the weights moved
    cnn = ModelStep("cnn", classes=3, image_key="img")
    cnn({"img": torch.rand(2, 3, 32, 32), "label": torch.tensor([0, 2])})
    assert cnn.calls == 1 and cnn.model[-1].out_features == 3
    with pytest.raises(ValueError, match="float32 CHW images"):
        cnn({"img": torch.zeros(2, 32, 32, 3, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="floating-point field"):
        ModelStep("mlp")({"label": torch.arange(4)})
    with pytest.raises(ValueError, match="step='rnn' must be one of mlp, cnn"):
        ModelStep("rnn")


def test_bench_bad_arguments(image_ds, tmp_path):
    p = run("-m", "fastload", "bench", image_ds, "--batch-size", "0")
    assert p.returncode == 1 and "--batch-size=0" in p.stderr
    p = run("-m", "fastload", "bench", tmp_path / "missing")
    assert p.returncode == 1 and "missing" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--plot", tmp_path / "nodir" / "x.png")
    assert p.returncode == 1 and "does not exist" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--plot", tmp_path / "x.jpg")
    assert p.returncode == 1 and "give a .png" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--workers", "0,two")
    assert p.returncode == 1 and "--workers='0,two'" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--step-ms", "-1")
    assert p.returncode == 1 and "--step-ms=-1.0 must be a number >= 0" in p.stderr
    p = run("-m", "fastload", "bench", image_ds, "--json", tmp_path / "nodir" / "r.json")
    assert p.returncode == 1 and "does not exist" in p.stderr


def test_bench_options_name_the_bad_value_and_the_allowed_ones():
    from fastload.bench.cli import BenchOptions
    from fastload.errors import UsageError

    assert BenchOptions().workers == (0, 2)
    for kw, msg in [({"batch_size": True}, "--batch-size=True must be an int >= 1"),
                    ({"epochs": 1.5}, "--epochs=1.5 must be an int >= 1"),
                    ({"threads": 0}, "--threads=0 must be an int >= 1 (or left unset)"),
                    ({"warmup": -1}, "--warmup=-1 must be an int >= 0"),
                    ({"transform": "train"}, "--transform='train' must be one of train224, eval224, none"),
                    ({"device": "gpu"}, "--device='gpu' must be one of auto, cpu, cuda"),
                    ({"compare": "dali"}, "--compare='dali' must be one of torch"),
                    ({"workers": ()}, "--workers names no num_workers value"),
                    ({"workers": (0, -2)}, "--workers=-2 must be an int >= 0"),
                    ({"step_ms": float("nan")}, "--step-ms=nan must be a number >= 0"),
                    ({"step": "rnn"}, "--step='rnn' must be one of mlp, cnn"),
                    ({"step": "mlp", "step_ms": 2.0}, "--step mlp and --step-ms 2: choose one")]:
        with pytest.raises(UsageError) as e:
            BenchOptions(**kw)
        assert str(e.value) == msg or str(e.value).startswith(msg), (kw, str(e.value))


# -- the DataLoader baseline does the Loader's work ------------------------------------------------
def test_pil_baseline_draws_the_loaders_windows_including_the_fallback():
    from fastload.bench.baseline import PILImageWork
    from fastload.pipeline.crops import train_params

    t = fastload.vision.train(224)
    work = PILImageWork(t, seed=7)
    rng = np.random.default_rng(0)
    for _ in range(50):
        i, e, w, h = int(rng.integers(0, 10**6)), int(rng.integers(0, 100)), int(rng.integers(8, 900)), int(rng.integers(8, 900))
        anchor, shape, flip = train_params(7, e, np.array([i]), np.array([w]), np.array([h]), t.scale, t.ratio, t.flip)
        assert work.window(i, e, w, h) == (*anchor[0].astype(int).tolist(), *shape[0].astype(int).tolist(), bool(flip[0]))
    # 1000x10: no attempt fits, so the fallback is the central crop with the ratio clamped to 4/3
    # (13x10), not a centre square (10x10)
    assert work.window(0, 0, 1000, 10)[:4] == (493, 0, 13, 10)
    assert work.window(0, 0, 10, 1000)[:4] == (0, 493, 10, 13)
    with pytest.raises(ValueError, match="dtype='float32', layout='CHW'"):
        PILImageWork(fastload.vision.train(224, dtype="uint8", layout="HWC"))


def test_pil_baseline_pixels_match_the_loader(tmp_path):
    """The DataLoader baseline delivers what the Loader delivers, image by image (same window,
    flip and normalisation; only the resampling differs slightly), also for an image on which
    RandomResizedCrop falls back to the central crop."""
    from fastload.bench.baseline import EpochSampler, ImageCollate, PILImageWork, TaggedDataset

    make_image_folder(tmp_path / "src", 7, seed=1, min_side=96, max_side=160)
    thin = (np.random.default_rng(0).random((12, 400, 3)) * 255).astype(np.uint8)
    Image.fromarray(thin).save(tmp_path / "src" / sorted(p.name for p in (tmp_path / "src").iterdir())[0] / "thin.jpg")
    fastload.convert("imagefolder", tmp_path / "src", tmp_path / "ds", progress=False)
    ds = fastload.Dataset(tmp_path / "ds")
    assert 400 in ds.image_sizes("image", np.arange(len(ds)))[0]
    t = fastload.vision.train(64)
    with fastload.Loader(ds, batch_size=len(ds), transforms={"image": t}, device="cpu", seed=0, shuffle=False) as ld:
        ld.set_epoch(3)
        b = next(iter(ld))
    idx = b["index"].numpy().tolist()
    collate = ImageCollate("image", PILImageWork(t, seed=0))
    sampler = EpochSampler(idx)
    sampler.set_epoch(3)
    ours = collate(TaggedDataset(ds).__getitems__(list(sampler)))["image"].numpy()
    sampler.set_epoch(4)
    other_epoch = collate(TaggedDataset(ds).__getitems__(list(sampler)))["image"].numpy()
    loader = b["image"].numpy()
    assert ours.shape == loader.shape == (len(ds), 3, 64, 64)
    same = np.abs(ours - loader).mean(axis=(1, 2, 3))
    different = np.abs(other_epoch - loader).mean(axis=(1, 2, 3))
    assert same.max() < 0.05, same  # normalised units: ~1/80 of the range of a channel
    assert np.median(different) > 0.3, different  # another epoch's windows: other pixels
    # the thin image: its fallback window (16x12 in the middle) is what the Loader decoded; the
    # centre square an older baseline took (12x12) gives other pixels
    j = idx.index(next(i for i in idx if ds.image_sizes("image", [i])[0][0] == 400))
    work = PILImageWork(t, seed=0)
    x, y, w, h, flip = work.window(idx[j], 3, 400, 12)
    assert (x, y, w, h) == (192, 0, 16, 12)
    square = Image.fromarray(thin).resize((64, 64), Image.BILINEAR, box=(194, 0, 206, 12))
    if flip:
        square = square.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    square = ((np.asarray(square, np.float32) / 255 - work.mean) / work.std).transpose(2, 0, 1)
    assert np.abs(square - loader[j]).mean() > 10 * same[j]


# -- the report module shared with bench/*.py ----------------------------------------------------
def test_report_timing_rows_and_tables():
    from fastload.bench import report
    from fastload.runtime.system import usable_cores

    calls = []
    med = report.interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     repeats=3, warmup=1)
    assert calls == ["a", "b"] * 4 and set(med) == {"a", "b"} and all(v >= 0 for v in med.values())
    with pytest.raises(ValueError, match="repeats=0 must be an int >= 1"):
        report.median_seconds(lambda: None, repeats=0)
    rows = [report.Measurement("ours", 1000, 4_000_000, 0.5, "ours", first_batch_s=0.25, wait_fraction=0.1),
            report.Measurement("dl", 1000, 4_000_000, 2.0, "dataloader"),
            report.Measurement("memcpy", 1000, 4_000_000, 0.25, "limit", "the limit")]
    assert rows[0].samples_per_s == 2000 and rows[0].mb_per_s == 8.0 and rows[0].gb_per_s == 0.008
    text = report.format_table(rows, rate="MB/s").splitlines()
    assert text[0].split() == ["system", "samples/s", "MB/s", "first", "batch", "(cold)", "stall", "vs", "DataLoader",
                               "vs", "limit", "note"]
    assert text[2].split() == ["ours", "2,000", "8.0", "0.250", "s", "10%", "4.00x", "50%"]
    assert text[3].split()[1:] == ["500", "2.0", "-", "-", "1.00x", "12%"]
    assert text[4].split()[-4:] == ["8.00x", "100%", "the", "limit"]
    assert report.Measurement.from_dict(rows[0].as_dict()) == rows[0]
    with pytest.raises(ValueError, match="kind='best'"):
        report.Measurement("x", 1, 1, 1.0, "best")
    m = report.machine_info()
    assert m["cores"] == usable_cores() and m["versions"]["fastload"] == fastload.__version__
    assert m["versions"]["dali"] and m["versions"]["torch"]
    assert report.system_info(m).startswith(f"{m['cpu']}, {m['cores']} cores")


def test_spreads_paired_ratios_and_tables_show_median_min_max(monkeypatch, tmp_path):
    import statistics

    from fastload.bench import report

    sp = report.Spread.of([3.0, 1.0, 2.0])
    assert (sp.median, sp.lo, sp.hi, sp.n) == (2.0, 1.0, 3.0, 3)
    assert sp.rate(6) == report.Spread(3.0, 2.0, 6.0, 3)  # the slowest repeat is the lowest rate
    assert sp.fmt(".1f", " s") == "2.0 s (1.0–3.0 s)" and report.Spread.of([2.0]).fmt(".1f") == "2.0"
    with pytest.raises(ValueError, match="lo <= median <= hi"):
        report.Spread(1.0, 2.0, 3.0)
    # a ratio between interleaved systems: the spread of the per-round ratios, around the medians' ratio
    a, b = [1.0, 4.0, 2.0, 8.0, 3.0], [2.0, 3.0, 3.0, 5.0, 1.0]
    pr = report.paired_ratios(a, b)
    assert pr.lo == 0.5 and pr.hi == 3.0 and pr.lo <= statistics.median(a) / statistics.median(b) <= pr.hi
    with pytest.raises(ValueError, match="equally long"):
        report.paired_ratios([1.0], [1.0, 2.0])
    calls = []
    times = report.interleaved_times({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")},
                                     repeats=3, warmup=2)
    assert calls == ["x", "y"] * 5 and [len(v) for v in times.values()] == [3, 3]
    # cold starts: each system built and its first batch taken round-robin; its closer runs untimed
    log = []

    def start(name):
        def s():
            log.append(f"start {name}")
            return lambda: log.append(f"close {name}")
        return s

    cold = report.interleaved_cold_starts({"a": start("a"), "b": start("b")}, repeats=2, warmup=1)
    assert log == ["start a", "close a", "start b", "close b"] * 3 and [len(v) for v in cold.values()] == [2, 2]
    # rows keep each round's rate: the table shows median (min-max) and paired ratios
    ours = report.Measurement.from_times("ours", 100, 10**6, [1.0, 2.0, 0.5], "ours", group="run")
    lim = report.Measurement.from_times("memcpy", 100, 10**6, [0.5, 1.0, 0.5], "limit", group="run")
    dl = report.Measurement.from_times("dl", 100, 10**6, [4.0, 4.0, 5.0], "dataloader")  # another run
    assert ours.seconds == 1.0 and ours.round_rates == [100.0, 50.0, 200.0]
    assert ours.rate_spread == report.Spread(100.0, 50.0, 200.0, 3)
    assert ours.paired(lim) == report.Spread(0.5, 0.5, 1.0, 3) and ours.paired(dl) is None
    lines = report.format_table([ours, lim, dl], rate="MB/s").splitlines()
    assert lines[2].split() == ["ours", "100", "(50–200)", "1.0", "4.00x", "50%", "(50–100%)"]
    assert lines[3].split() == ["memcpy", "200", "(100–200)", "2.0", "8.00x", "100%"]
    assert lines[4].split() == ["dl", "25", "(20–25)", "0.2", "1.00x", "12%"]
    assert report.Measurement.from_dict(ours.as_dict()) == ours
    old = {k: v for k, v in ours.as_dict().items() if k not in ("round_rates", "group", "first_batch_range")}
    assert report.Measurement.from_dict(old).rate_spread.n == 1  # JSON written before spreads: still read
    # headlines carry the spreads, the paired ratios and the cold first batches into the README table
    monkeypatch.setenv(report.RESULTS_ENV, str(tmp_path / "h.jsonl"))
    rec = report.headline("w", script="bench_x.py", unit="img/s", ours=("L", ours.rate_spread),
                          baseline=("DL", 25.0), limit=("DALI", lim.rate_spread), vs_limit=ours.paired(lim),
                          first_batch={"L": report.Spread(0.4, 0.3, 0.5, 3), "DL": 0.6}, note="n")
    assert rec["ours"] == ["L", 100.0] and rec["ours_range"] == [50.0, 200.0] and "baseline_range" not in rec
    assert rec["vs_limit_range"] == [0.5, 1.0] and rec["first_batch_s"] == {"L": [0.4, 0.3, 0.5], "DL": [0.6]}
    assert json.loads((tmp_path / "h.jsonl").read_text()) == rec
    assert report.markdown_table([rec]).splitlines()[2] == (
        "| w (`python bench/bench_x.py`) | L: 100 (50–200) img/s (n; first batch (cold): L 0.40 (0.30–0.50) s, "
        "DL 0.60 s) | DL: 25.00 img/s | DALI: 200 (100–200) img/s | 4.00x | 50% (50–100%) |")
    with pytest.raises(ValueError, match="first_batch"):
        report.headline("w", script="x", unit="u", ours=("L", 1.0), first_batch={"L": 0.0})


def test_bench_scripts_smoke(tmp_path, monkeypatch, capsys, request):
    """Every bench/ script at a tiny size, through the one entry point, so none can rot; each
    records a headline (fastload beside its baseline/limit) and the results table is made
    from those records."""
    res, md = tmp_path / "results.json", tmp_path / "results.md"
    run_all = _load_run_all()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ray = importlib.util.find_spec("ray") is not None
    if ray:  # bench_convert's ray rows on the session's Ray (tests/_ray.py), not a private one each
        cluster = request.getfixturevalue("ray_cluster")
        for k, v in cluster.env(dict(os.environ)).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("FASTLOAD_BENCH_RAY_ADDRESS", cluster.address)
    monkeypatch.chdir(ROOT)
    # run_all here, three scripts at a time (several wait on sockets and sleeps), each in a process
    # of its own forked from one of the tests' launchers (tests/_zygote.py); bench_convert's
    # torchrun ranks and engine processes forked too (its python: the launcher's shim)
    code = run_all.main(["--smoke", "--jobs", "3", "--results", str(res), "--markdown", str(md)],
                        run=lambda cmd, **kw: run_python(*cmd[1:], env=kw["env"], cwd=ROOT, timeout=900,
                                                         fork_python=cmd[1].endswith("bench_convert.py")))
    p = SimpleNamespace(returncode=code, **dict(zip(("stdout", "stderr"), capsys.readouterr())))
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
    # the cold first batch of fastload beside the DataLoader's (and DALI alone's), the CNN's CPU bound
    jpeg = next(r for r in records if r["script"] == "bench_jpeg.py")
    assert {"Loader", "DALI alone"} <= set(jpeg["first_batch_s"]) and any(
        k.startswith("DataLoader") for k in jpeg["first_batch_s"]), jpeg
    assert "FFCV" in jpeg["note"] and jpeg["limit"][0] == "DALI alone from files"
    loops = [r for r in records if r["script"] == "bench_loop.py"]
    assert len(loops) == 2 and all("Loader" in r["first_batch_s"] for r in loops)  # smoke: default torch threads
    assert sum("the CPU bound" in r["note"] for r in loops) == 1  # the CNN's
    assert ("--engine ray --workers 2" in p.stdout) == ray and (f"joined the Ray at {cluster.address}" in p.stdout if ray else True)
    tensor = [r for r in records if r["script"] == "bench_tensor.py"]
    assert all("Ring alone with the Loader's settings" in r["note"] for r in tensor)
    table = md.read_text().strip().splitlines()
    assert table[0].startswith("| workload") and len(table) == 2 + len(records)
    for r, line in zip(records, table[2:]):
        assert f"`python bench/{r['script']}`" in line and line.count("|") == 7


def test_dali_stages_diagnostic_smoke():
    """bench/dali_stages.py (issue 17's decode-vs-resize breakdown, not in run_all): it runs
    and reports every stage with a positive rate."""
    pytest.importorskip("nvidia.dali")
    p = run(ROOT / "bench" / "dali_stages.py", "--smoke", timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for row in ("DALI ROI decode ", "DALI ROI decode + resize ", "no antialias", "torch resize"):
        line = next(ln for ln in p.stdout.splitlines() if row in ln)
        assert float(re.search(r"([\d,]+) img/s", line).group(1).replace(",", "")) > 0, line
    assert "CPU per image: decode" in p.stdout


def _load_run_all():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "bench" / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    return run_all


def test_results_table_is_replaced_between_markers(tmp_path):
    run_all = _load_run_all()
    assert run_all.RESULTS_PAGE == ROOT / "docs" / "benchmarks.md"
    real = run_all.RESULTS_PAGE.read_text()  # the published page has exactly one block to replace
    assert real.count(run_all.BEGIN) == 1 and real.count(run_all.END) == 1
    readme = tmp_path / "benchmarks.md"
    readme.write_text(f"# x\nbefore\n{run_all.BEGIN}\nold table\n{run_all.END}\nafter\n")
    rec = {"workload": "w", "script": "bench_open.py", "unit": "ms", "lower_is_better": True,
           "ours": ["a", 2.0], "baseline": ["b", 10.0], "limit": None, "note": "", "machine": "m"}
    table = run_all.markdown_table([rec])
    run_all.update_results_page([rec], table, ["open"], page=readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\nbefore\n") and text.endswith("after\n")
    assert "| w (`python bench/bench_open.py`) | a: 2.00 ms | b: 10.00 ms | – | 5.00x | – |" in text
    assert "--docs --only open" in text and "on: m." in text
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="expected one"):
        run_all.update_results_page([rec], table, ["open"], page=readme)
    assert readme.read_text() == "no markers"


def test_a_partial_run_replaces_only_its_rows_and_says_when(tmp_path):
    run_all = _load_run_all()
    page = tmp_path / "benchmarks.md"

    def rec(script, workload, value, machine):
        return {"workload": workload, "script": script, "unit": "ms", "lower_is_better": True,
                "ours": ["a", value], "baseline": ["b", 10.0], "limit": None, "note": "", "machine": machine}

    first = [rec("bench_tensor.py", "t", 1.0, "m1"), rec("bench_sampler.py", "s", 2.0, "m1"),
             rec("bench_open.py", "o", 3.0, "m1")]
    page.write_text(f"top\n{run_all.BEGIN}\nold\n{run_all.END}\nbottom\n")
    run_all.update_results_page(first, run_all.markdown_table(first), list(run_all.SCRIPTS), page=page)
    again = [rec("bench_sampler.py", "s", 5.0, "m2")]
    run_all.update_results_page(again, run_all.markdown_table(again), ["sampler"], page=page)
    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "python bench/" in line]
    assert [r.split(" (`")[0] for r in rows] == ["| t", "| s", "| o"]  # the row stays where it stood
    assert "a: 5.00 ms" in rows[1] and "a: 1.00 ms" in rows[0] and "a: 3.00 ms" in rows[2]
    assert "a: 2.00 ms" not in text
    assert "by `python bench/run_all.py --docs` on: m1._" in text  # the other rows' attribution kept
    assert "_Rows of bench_sampler.py measured again on " in text and "--docs --only sampler` on: m2._" in text
    assert text.startswith("top\n") and text.endswith("bottom\n")
    run_all.update_results_page(again, run_all.markdown_table(again), ["sampler"], page=page)
    assert page.read_text().count("_Rows of bench_sampler.py") == 1  # a later rerun replaces its line


def test_run_all_refuses_smoke_figures_in_docs():
    for flag in ("--docs", "--readme"):  # --readme: the flag's old name, kept
        p = run(ROOT / "bench" / "run_all.py", "--smoke", flag, "--only", "open")
        assert p.returncode == 2 and "--docs publishes figures" in p.stderr


def test_run_all_runs_scripts_side_by_side_only_at_smoke_size():
    for args in (["--jobs", "2"], ["--jobs", "0", "--smoke"]):
        p = run(ROOT / "bench" / "run_all.py", *args, "--only", "open")
        assert p.returncode == 2 and "use --jobs 2 or more only with --smoke" in p.stderr, p.stderr
