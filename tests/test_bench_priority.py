"""Benchmarks that compare loaders without a training step run fastload's threads at the
priority of the rows beside them (``fastload.bench.machine.equal_priority``), say so on the
machine line, and leave the default (nice 19, for training) alone where a step runs."""
from __future__ import annotations

import json

import numpy as np
import pytest

import fastload
from fastload.bench.machine import equal_priority, machine_info, system_info
from fastload.cli import main
from fastload.runtime.system import LOADER_NICE


def test_equal_priority_sets_zero_unless_the_environment_chose(monkeypatch):
    monkeypatch.delenv("FASTLOAD_NICE", raising=False)
    assert equal_priority() == 0
    monkeypatch.setenv("FASTLOAD_NICE", "7")
    assert equal_priority() == 7  # FASTLOAD_NICE=19 python bench/... measures the default
    assert machine_info()["loader_nice"] == 7
    assert "fastload threads at nice 7" in system_info()


def test_an_old_report_without_the_value_still_formats(monkeypatch):
    m = machine_info()
    del m["loader_nice"]
    assert "nice" not in system_info(m)


@pytest.fixture
def tiny(tmp_path):
    with fastload.ShardWriter(tmp_path / "ds", {"x": "float32[16]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.zeros((400, 16), np.float32), "label": np.arange(400) % 10})
    return tmp_path


@pytest.mark.parametrize("step, nice", [((), 0), (("--step-ms", "1"), LOADER_NICE)])
def test_fastload_bench_compares_at_one_priority_and_restores_the_environment(tiny, monkeypatch, step, nice):
    monkeypatch.delenv("FASTLOAD_NICE", raising=False)
    out = tiny / "r.json"
    assert main(["bench", str(tiny / "ds"), "--batch-size", "100", "--epochs", "1", "--json", str(out), "--no-progress",
                 *step]) == 0
    assert json.loads(out.read_text())["machine"]["loader_nice"] == nice
    import os

    assert "FASTLOAD_NICE" not in os.environ  # run in-process: nothing left behind
