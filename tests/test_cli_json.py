"""``--json`` takes an optional FILE, so argparse hands the dataset of ``fastload verify
--json DS`` (the README's form) to ``--json``: every command that takes a dataset PATH
reads it back as the dataset, with the JSON on stdout, and keeps the ``--json FILE DS``,
``DS --json FILE`` and ``DS --json`` forms (tests/test_cli.py has the rest)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import fastload
from fastload import cli

from _damage import damaged_copy


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    d = tmp_path_factory.mktemp("clijson") / "ds"
    with fastload.ShardWriter(d, {"x": "float32[4]", "label": "int64"}, label="label") as w:
        w.write_batch({"x": np.arange(40 * 4, dtype=np.float32).reshape(40, 4), "label": np.arange(40) % 3})
    return d


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("form", ["--json DS", "DS --json", "DS --json -", "--json - DS"])
def test_verify_json_before_or_after_the_dataset_prints_the_result(ds, capsys, form):
    argv = [ds if t == "DS" else t for t in form.split()]
    code, out, err = run(capsys, "verify", *argv)
    assert code == 0, err
    assert json.loads(out) == {"path": str(ds), "ok": True, "problems": []}
    assert "OK" in err  # the human line goes to stderr when stdout holds the JSON


def test_verify_json_file_before_the_dataset_writes_the_file(ds, capsys, tmp_path):
    code, out, err = run(capsys, "verify", "--json", tmp_path / "v.json", ds)
    assert code == 0, err
    assert f"wrote {tmp_path / 'v.json'}\n" in out and "OK" in out
    assert json.loads((tmp_path / "v.json").read_text())["ok"] is True


def test_verify_json_ds_names_the_damaged_shard_and_exits_1(ds, capsys, tmp_path):
    bad = tmp_path / "bad"
    shard = damaged_copy(ds, bad)
    code, out, err = run(capsys, "verify", "--json", bad)
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["problems"]) == 1 and shard.name in doc["problems"][0]


@pytest.mark.parametrize("argv", [["verify"], ["verify", "--json"], ["verify", "--json", "-"]])
def test_verify_without_a_dataset_is_still_a_usage_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "verify" in err and "required" in err and "PATH" in err


def test_inspect_json_ds_prints_the_manifest(ds, capsys):
    code, out, err = run(capsys, "inspect", "--json", ds)
    assert code == 0, err
    assert json.loads(out) == json.loads((ds / "manifest.json").read_text())
