"""Stats (fastload/loader/stats.py), the one object a Loader's parts report into: per-epoch
counters (add), cumulative probes counted from the epoch's start (attach, with an optional
derive), and gauges read as they are (gauge). ``Loader.stats()`` is ``Stats.report()``."""
from __future__ import annotations

from fastload.loader.stats import Stats


class Part:
    """A long-lived part with cumulative counters."""

    def __init__(self):
        self.busy_s = 0.0
        self.bytes = 0

    def probe(self):
        return {"bytes_read": self.bytes, "busy_s": self.busy_s}


def mbps(out: dict) -> dict:
    busy = out.pop("busy_s", 0.0)
    out["read_MBps"] = out["bytes_read"] / busy / 1e6 if busy > 0 else 0.0
    return out


def test_counters_probes_derives_and_gauges_in_one_report():
    st, part = Stats(), Part()
    part.bytes = 5_000_000  # before the loader started: not this epoch's
    st.attach("part", part.probe, derive=mbps)
    slots = {"free": 3}
    st.gauge("epoch", lambda: 7)
    st.gauge("ring", lambda: dict(slots) if slots else None)  # None: left out
    st.begin_epoch()
    st.add("decode_s", 0.25)
    st.add("replaced_samples", 2)
    part.bytes += 3_000_000
    part.busy_s += 1.5
    st.delivered(10, 100, 0.01, 0.0)
    r = st.report()
    assert r["bytes_read"] == 3_000_000 and r["read_MBps"] == 2.0 and "busy_s" not in r
    assert r["stages"]["decode_s"] == 0.25 and r["replaced_samples"] == 2 and r["samples"] == 10
    assert r["epoch"] == 7 and r["ring"] == {"free": 3}
    keys = list(r)
    assert keys[-2:] == ["epoch", "ring"]  # gauges last, in the order registered
    assert keys.index("read_MBps") < keys.index("epoch")  # derived before the gauges
    slots.clear()
    assert "ring" not in st.report()
    # the counters alone (a log line every N batches) read no gauge and derive nothing
    snap = st.snapshot()
    assert "epoch" not in snap and snap["busy_s"] == 1.5


def test_after_detach_all_the_report_keeps_the_last_values_and_gauges_stay_live():
    st, part = Stats(), Part()
    st.attach("part", part.probe, derive=mbps)
    n = [0]
    st.gauge("seen", lambda: n[0])
    st.begin_epoch()
    part.bytes, part.busy_s = 2_000_000, 2.0
    st.detach_all()  # the parts close
    part.bytes = 10**9  # not read any more
    n[0] = 4
    r = st.report()
    assert r["bytes_read"] == 2_000_000 and r["read_MBps"] == 1.0 and r["seen"] == 4


def test_a_new_epoch_counts_the_probes_from_its_start():
    st, part = Stats(), Part()
    st.attach("part", part.probe)
    st.begin_epoch()
    part.bytes = 100
    assert st.report()["bytes_read"] == 100
    st.begin_epoch()
    part.bytes = 130
    assert st.report()["bytes_read"] == 30
    st.attach("part", part.probe, derive=mbps)  # attached again (a new ring): counts from now
    assert st.report()["bytes_read"] == 0 and "read_MBps" in st.report()
    st.attach("part", part.probe)  # ...and without a derive now
    assert "read_MBps" not in st.report()
