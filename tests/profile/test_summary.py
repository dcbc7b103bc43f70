"""Summary maths on hand-made intervals: union busy time, GB/s, ceilings, bottleneck, waits."""
import json

import pytest

from infinity.profile import Timeline
from infinity.profile.summary import (load_ceilings, merge_intervals, subtract_intervals,
                                      summarize, total_length)


def make(events, steps=(), counters=None):
    tl = Timeline(enabled=True)
    for lane, name, t0, t1, nb in events:
        tl.add(lane, name, t0, t1, nb)
    with tl._lock:  # deterministic step marks at chosen times
        tl._steps.extend(steps)
    for k, v in (counters or {}).items():
        tl.count(k, v)
    tl.enabled = False  # keep the window defined by events/marks only
    return tl


def test_interval_union_and_subtraction():
    iv = [(0, 2), (1, 3), (5, 6), (6, 7), (10, 10.5)]
    assert merge_intervals(iv) == [(0, 3), (5, 7), (10, 10.5)]
    assert total_length(iv) == pytest.approx(5.5)
    assert subtract_intervals([(0, 10)], [(1, 2), (4, 5), (9, 12)]) == [(0, 1), (2, 4), (5, 9)]
    assert subtract_intervals([(0, 1), (2, 3)], [(0.5, 2.5)]) == [(0, 0.5), (2.5, 3)]
    assert subtract_intervals([(0, 1)], []) == [(0, 1)]
    assert subtract_intervals([(0, 1)], [(-1, 5)]) == []


def test_gbps_uses_union_of_overlapping_transfers():
    # two reads in flight: 0-2 s and 1-3 s, 3 GB in total -> busy 3 s -> 1 GB/s (not 3/4)
    tl = make([("nvme_read", "a", 0.0, 2.0, 2_000_000_000),
               ("nvme_read", "b", 1.0, 3.0, 1_000_000_000),
               ("forward", "l0", 3.0, 4.0, 0)])
    s = summarize(tl, ceilings={"nvme_read": 2.0})
    r = s["links"]["nvme_read"]
    assert s["window_s"] == pytest.approx(4.0)
    assert r["busy_s"] == pytest.approx(3.0)
    assert r["achieved_gbps"] == pytest.approx(1.0)
    assert r["effective_gbps"] == pytest.approx(0.75)
    assert r["of_ceiling"] == pytest.approx(0.5)
    assert s["bottleneck"]["lane"] == "nvme_read"
    assert s["bottleneck"]["sentence"] == "step is NVMe-read bound: 75 % of step time"


def test_compute_bound_and_wait_is_not_compute():
    # forward spans 0-10 but contains a 4 s wait: compute is 6 s, the write link 3 s
    tl = make([("forward", "l0", 0.0, 10.0, 0),
               ("wait", "layers.1", 2.0, 4.0, 0),
               ("wait", "layers.2", 6.0, 8.0, 0),
               ("wait", "layers.2", 8.0, 8.0, 0),
               ("nvme_write", "t", 0.0, 3.0, 3_000_000)])
    s = summarize(tl)
    assert s["compute"]["total"]["busy_s"] == pytest.approx(6.0)
    assert s["bottleneck"]["lane"] == "compute"
    assert s["bottleneck"]["sentence"] == "step is compute-bound: 60 % of step time"
    assert s["wait"]["total_s"] == pytest.approx(4.0)
    by = {d["layer"]: d for d in s["wait"]["by_layer"]}
    assert by["layers.1"]["wait_s"] == pytest.approx(2.0)
    assert by["layers.2"]["count"] == 2
    # sorted descending by wait time, ties keep both
    assert {d["layer"] for d in s["wait"]["by_layer"]} == {"layers.1", "layers.2"}


@pytest.mark.parametrize("lane,label", [("nvme_write", "NVMe-write"), ("h2d", "H2D"),
                                        ("d2h", "D2H"), ("allgather", "all-gather"),
                                        ("reduce_scatter", "reduce-scatter")])
def test_bottleneck_picks_link_with_most_exposed_time(lane, label):
    # the link is busy 0-8 s; compute runs 6-7 and 9-10: 6 of the link's 8 s are exposed
    tl = make([(lane, "x", 0.0, 8.0, 8), ("nvme_read", "y", 0.0, 5.0, 5),
               ("backward", "z", 6.0, 7.0, 0), ("optimizer", "o", 9.0, 10.0, 0)])
    s = summarize(tl)
    assert s["links"][lane]["busy_fraction"] == pytest.approx(0.8)
    assert s["links"][lane]["exposed_fraction"] == pytest.approx(0.7)
    assert s["bottleneck"]["lane"] == lane
    assert s["bottleneck"]["sentence"] == f"step is {label} bound: 70 % of step time"


def test_transfers_hidden_under_compute_are_not_the_bottleneck():
    # reads in flight 0-9.5 s (prefetch issued early, waited for late) while compute runs
    # 0.5-10 s with 0.2 s of waits: busier link, but the step is compute-bound
    tl = make([("nvme_read", "r", 0.0, 9.5, 10**9), ("forward", "f", 0.5, 5.0, 0),
               ("backward", "b", 5.0, 10.0, 0), ("wait", "layers.0", 0.5, 0.7, 0)])
    s = summarize(tl)
    assert s["links"]["nvme_read"]["busy_fraction"] == pytest.approx(0.95)
    assert s["links"]["nvme_read"]["exposed_fraction"] == pytest.approx(0.07)
    # the busy link is named: hidden now, it bounds the step once compute gets faster
    assert s["bottleneck"]["sentence"] == ("step is compute-bound: 93 % of step time (NVMe-read "
                                           "busy 95 % of it, hidden under compute: the next bound)")


def test_a_link_busy_less_than_half_the_step_is_not_named_next_to_compute():
    tl = make([("nvme_read", "r", 1.0, 5.0, 10**9), ("forward", "f", 0.0, 5.0, 0),
               ("backward", "b", 5.0, 10.0, 0)])
    s = summarize(tl)
    assert s["links"]["nvme_read"]["busy_fraction"] == pytest.approx(0.4)
    assert s["bottleneck"]["sentence"] == "step is compute-bound: 100 % of step time"


def test_overhead_bound_when_nothing_busy_most_of_the_time():
    tl = make([("h2d", "x", 0.0, 1.0, 1), ("forward", "f", 2.0, 3.0, 0)],
              steps=[(1, 0.0), (2, 5.0)])
    tl.t_end = 10.0
    s = summarize(tl)
    assert s["window_s"] == pytest.approx(10.0)
    assert s["bottleneck"]["lane"] == "overhead"
    assert "80 %" in s["bottleneck"]["sentence"]
    assert [r["step"] for r in s["steps"]] == [1, 2]
    assert s["steps"][0]["time_s"] == pytest.approx(5.0)
    assert s["steps"][0]["busy_fraction"]["h2d"] == pytest.approx(0.2)
    assert s["steps"][1]["busy_fraction"]["compute"] == pytest.approx(0.0)
    # a window starting before the first mark gets a leading row; a mark at the end none
    tl2 = make([("h2d", "x", 0.0, 1.0, 1), ("forward", "f", 2.0, 3.0, 0)], steps=[(7, 2.0), (8, 3.0)])
    rows = summarize(tl2)["steps"]
    assert [(r["step"], r.get("before_step")) for r in rows] == [(None, 7), (7, None)]
    assert rows[0]["busy_fraction"]["h2d"] == pytest.approx(0.5)


def test_prefetch_hit_rate_from_timeline_counters():
    tl = make([("h2d", "x", 0.0, 1.0, 1)], counters={"prefetched": 9, "on_demand": 3})
    s = summarize(tl)
    assert s["prefetch"] == {"prefetched": 9, "on_demand": 3, "hit_rate": pytest.approx(0.75)}
    assert summarize(make([("h2d", "x", 0.0, 1.0, 1)]))["prefetch"] is None


def test_ceilings_from_bench_io_file(tmp_path):
    f = tmp_path / "bench.json"
    f.write_text(json.dumps({"engine": "uring", "results": [
        {"block_size": 262144, "read_gbps": 1.5, "write_gbps": 0.9},
        {"block_size": 1048576, "read_gbps": 2.5, "write_gbps": 1.1}]}))
    assert load_ceilings(str(f)) == {"nvme_read": 2.5, "nvme_write": 1.1}
    g = tmp_path / "r.json"
    g.write_text(json.dumps({"read_gbps": 3.0}))
    assert load_ceilings(g) == {"nvme_read": 3.0}
    assert load_ceilings({"read_gbps": 2, "nvme_write": 1}) == {"nvme_read": 2.0, "nvme_write": 1.0}
    with pytest.raises(ValueError, match="unknown link"):
        load_ceilings({"pcie": 1})
    with pytest.raises(ValueError, match="positive"):
        load_ceilings({"nvme_read": 0})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_ceilings(bad)
    with pytest.raises(OSError, match="bench-io"):
        load_ceilings(tmp_path / "missing.json")


def test_empty_timeline_summary():
    s = summarize(Timeline())
    assert s["window_s"] == 0.0 and s["links"] == {} and s["bottleneck"]["lane"] is None


def test_counter_bytes_mismatch_is_reported():
    from infinity.profile.summary import format_summary
    tl = make([("nvme_write", "t", 0.0, 1.0, 100)])
    s = summarize(tl, counters={"nvme_write_bytes": 150})
    assert s["links"]["nvme_write"]["counter_bytes"] == 150
    assert "the runtime counted 150 bytes, the timeline 100" in format_summary(s)
    s = summarize(tl, counters={"nvme_write_bytes": 100})
    assert "runtime counted" not in format_summary(s)
