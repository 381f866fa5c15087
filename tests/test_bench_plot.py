"""`fastload bench --plot`: refused before any work when matplotlib is missing (naming the
extra to install), and the PNG's value labels sit clear of the error-bar caps."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fastload.bench.report import Measurement


def test_plot_without_matplotlib_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import fastload.bench.runs
    from fastload.cli import main

    calls = []
    monkeypatch.setattr(fastload.bench.runs, "run", lambda *a, **k: calls.append(a) or {})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "bench.png"
    rc = main(["bench", str(tmp_path), "--plot", str(png)])
    err = capsys.readouterr().err
    assert rc == 1, err  # a UsageError, as for the other --plot checks
    assert calls == []  # nothing was measured
    assert "pip install 'fastload[bench]'" in err and "--plot" in err and "matplotlib" in err, err
    assert "Traceback" not in err
    assert not png.exists()


def test_plot_without_matplotlib_cli_subprocess(tmp_path):
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['fastload'] + sys.argv[1:]; "
            "runpy.run_module('fastload', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "bench", str(tmp_path / "missing-dataset"),
                        "--plot", str(tmp_path / "b.png")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "fastload[bench]" in p.stderr and "Traceback" not in p.stderr, p.stderr


def _rows():
    # a wide spread: the fastest repeat is far right of the median, where the old label started
    return [Measurement("fastload Loader", 2873 * 4, 0, 4.0, "ours", round_rates=[2600.0, 2873.0, 3900.0]),
            Measurement("DataLoader num_workers=2", 1200 * 4, 0, 4.0, "dataloader",
                        round_rates=[900.0, 1200.0, 1700.0]),
            Measurement("one value", 500, 0, 1.0, "other")]


def test_plot_labels_clear_the_error_bar_caps(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from fastload.bench.report import plot

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    png = tmp_path / "bench.png"
    rows = _rows()
    plot(rows, png, "test")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = figs[0]
    ax = fig.axes[0]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    labels = {t.get_text().strip(): t for t in ax.texts}
    assert set(labels) == {f"{x.samples_per_s:,.0f}" for x in rows}
    for x in rows:
        t = labels[f"{x.samples_per_s:,.0f}"]
        left_px = t.get_window_extent(r).x0
        cap_px = ax.transData.transform((x.rate_spread.hi, 0))[0]
        assert left_px > cap_px + 2, (x.system, left_px, cap_px)  # starts right of the cap
        assert t.get_window_extent(r).x1 <= ax.get_window_extent(r).x1  # inside the axes
    plt.close(fig)
