"""An overwrite killed (SIGKILL) at every step of its swap: DST opens as exactly the old or
exactly the new dataset, or says how to finish; recovery — the command the message names, or
the next overwrite — leaves exactly one dataset (nothing of the other), and verify passes."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import fastload
from _zygote import run_python
from fastload.errors import FormatError
from fastload.store import DatasetReader, ShardWriter
from fastload.store.recover import main as recover_main
from fastload.store.report import write_report

OLD = np.arange(40, dtype=np.int64)
NEW = np.arange(100, 130, dtype=np.int16)
NEXT = np.arange(7, dtype=np.int8)

# The overwrite, in a child process: ``_reached`` (called after every step of the swap that
# changes the directory) prints the step and kills the process at step number KILL (0: never).
CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import fastload.store.transaction as t
    from fastload.store import ShardWriter
    from fastload.store.report import write_report

    d, kill, report = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    n = [0]
    def reached(step):
        n[0] += 1
        print(step, flush=True)
        if n[0] == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    t._reached = reached
    with ShardWriter(d, {"y": "int16"}, overwrite=True, shard_size=24) as w:
        w.write_batch({"y": np.arange(100, 130, dtype=np.int16)})
        if report:
            write_report(w.dir / "skipped.jsonl", [{"index": 3, "key": "new", "reason": "bad"}])
""")


def _old(d: Path, report: bool) -> None:
    with ShardWriter(d, {"x": "int64"}, shard_size=80) as w:
        w.write_batch({"x": OLD})
    if report:
        write_report(d / "skipped.jsonl", [{"index": 0, "key": "old", "reason": "bad"}])


def _overwrite(d: Path, kill: int, report: bool) -> tuple[int, list[str]]:
    p = run_python("-c", CHILD, d, kill, "1" if report else "0", timeout=120)  # (forked: no start-up each)
    # the steps, with the new shards' generation token (random) left out
    return p.returncode, [re.sub(r"-[0-9a-f]{8}\.arrow", ".arrow", x) for x in p.stdout.split()]


def _exactly(d: Path) -> str:
    """"old" or "new" when ``d`` holds exactly that dataset (its files and nothing else, its
    values, its report) and verify passes; raises otherwise."""
    r = DatasetReader(d)
    m = r.manifest
    field = next(iter(m["fields"]))
    values = np.concatenate([r.get_batch(np.arange(len(r)))[field]])
    which = {"x": "old", "y": "new", "z": "next"}[field]
    want = {"old": OLD, "new": NEW, "next": NEXT}[which]
    assert values.dtype == want.dtype and values.tolist() == want.tolist()
    files = {"manifest.json", *(s["file"] for s in m["shards"])}
    report = d / "skipped.jsonl"
    if report.exists():
        files.add("skipped.jsonl")
        assert json.loads(report.read_text())["key"] == which
    assert set(os.listdir(d)) == files, sorted(os.listdir(d))
    assert fastload.verify(d, remember=False) == []
    return which


def _state(d: Path) -> str:
    """What a reader sees right after the kill."""
    try:
        DatasetReader(d)
    except FormatError as e:
        assert "interrupted while swapping" in str(e) and f"fastload recover {d}" in str(e), str(e)
        return "refused"
    m = json.loads((d / "manifest.json").read_text())
    field = next(iter(m["fields"]))
    r = DatasetReader(d)
    assert r.get_batch(np.arange(len(r)))[field].tolist() == (OLD if field == "x" else NEW).tolist()
    return "old" if field == "x" else "new"


@pytest.mark.parametrize("old_report,new_report", [(True, True), (True, False), (False, True)])
def test_a_kill_at_every_step_of_the_swap_is_recovered_exactly(tmp_path, old_report, new_report):
    template = tmp_path / "template"
    _old(template, old_report)
    shutil.copytree(template, tmp_path / "dry")
    rc, steps = _overwrite(tmp_path / "dry", 0, new_report)
    assert rc == 0 and _exactly(tmp_path / "dry") == "new"
    assert steps[:2] == ["aside-created", "journal-written"] and steps[-1] == "done"
    assert steps[2] == "aside:manifest.json"  # the old dataset stops opening before any of its shards goes
    assert "published" in steps and sum(s.startswith("up:") for s in steps) >= 3
    seen = {}
    for k, step in enumerate(steps, start=1):
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d)
        rc, printed = _overwrite(d, k, new_report)
        assert rc == -signal.SIGKILL and printed[-1] == step, (k, step, rc, printed)
        seen[step] = _state(d)
        before_publish = k < steps.index("published") + 1
        assert seen[step] == ("refused" if "aside:manifest.json" in printed and before_publish else
                              "old" if before_publish else "new"), (step, seen[step])
        # recovery by the message's command
        by_message = tmp_path / f"m{k}"
        shutil.copytree(d, by_message)
        assert recover_main([str(by_message)]) == 0
        got = _exactly(by_message)
        assert got == ("old" if step == "aside-created" else "new"), (step, got)
        # recovery by the next run: an overwrite of its own, leaving exactly that one
        with ShardWriter(d, {"z": "int8"}, overwrite=True) as w:
            w.write_batch({"z": NEXT})
        assert _exactly(d) == "next"
        shutil.rmtree(d)
        shutil.rmtree(by_message)
    assert set(seen.values()) == {"old", "refused", "new"}


@pytest.mark.parametrize("command", [["-m", "fastload.store.recover"], ["-m", "fastload", "recover"]])
def test_the_recover_command_runs(tmp_path, command):
    d = tmp_path / "ds"
    _old(d, True)
    rc, steps = _overwrite(d, 5, True)  # killed with the old dataset partly moved aside
    assert rc == -signal.SIGKILL and _state(d) == "refused"
    p = subprocess.run([sys.executable, *command, str(d)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "finished an overwrite" in p.stdout, p.stderr
    assert _exactly(d) == "new"
    p = subprocess.run([sys.executable, *command, str(d)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "no interrupted overwrite" in p.stdout and _exactly(d) == "new"


def test_an_overwrite_killed_by_an_older_fastload_is_finished_exactly(tmp_path):
    """The issue's case, left by the swap before this one (no journal): the old manifest and
    some old shards deleted, some new shards moved up, the rest with the new manifest in the
    staging directory. Recovery removes the old shards the message used to leave behind."""
    d = tmp_path / "ds"
    _old(d, True)
    new = tmp_path / "new"
    with ShardWriter(new, {"y": "int16"}, shard_size=24) as w:
        w.write_batch({"y": NEW})
    write_report(new / "skipped.jsonl", [{"index": 3, "key": "new", "reason": "bad"}])
    staging = d / ".fastload-staging-0123456789ab"
    staging.mkdir()
    new_shards = sorted(s["file"] for s in json.loads((new / "manifest.json").read_text())["shards"])
    # the new shards named with a generation, as when replacing a dataset
    m = json.loads((new / "manifest.json").read_text())
    for s in m["shards"]:
        gen = s["file"].replace(".arrow", "-0badc0de.arrow")
        shutil.copy(new / s["file"], staging / gen)
        s["file"] = gen
    from fastload.manifest_checksum import manifest_bytes
    (staging / "manifest.json").write_bytes(manifest_bytes(m))
    shutil.copy(new / "skipped.jsonl", staging / "skipped.jsonl")
    old_shards = sorted(p.name for p in d.glob("shard-*.arrow"))
    assert len(old_shards) >= 3 and len(new_shards) >= 3
    os.unlink(d / "manifest.json")  # the old swap: manifest first, then shards in directory order
    os.unlink(d / old_shards[0])
    with pytest.raises(FormatError, match="interrupted while swapping"):
        DatasetReader(d)
    assert recover_main([str(d)]) == 0
    assert _exactly(d) == "new"
