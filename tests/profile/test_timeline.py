"""Timeline recording: disabled is a no-op, lanes validated, thread safety, session lifecycle."""
import threading
import time

import pytest

from infinity.profile import DISABLED, LANES, ProfileSession, Timeline, as_timeline


def test_disabled_timeline_records_nothing():
    tl = Timeline()
    assert not tl.enabled
    tl.add("nvme_read", "x", 0.0, 1.0, 100)
    with tl.span("forward", "layer") as s:
        pass
    tl.mark_step(1)
    tl.count("prefetched")
    assert len(tl) == 0 and tl.steps() == [] and tl.counters() == {}
    assert tl.window() == (None, None)
    # the disabled span is one shared object: no allocation per call
    assert tl.span("h2d", "a") is tl.span("d2h", "b")
    assert as_timeline(None) is DISABLED
    with pytest.raises(RuntimeError):
        DISABLED.enable()


def test_enabled_records_span_and_add():
    tl = Timeline(enabled=True)
    with tl.span("forward", "layers.0") as s:
        s.nbytes = 0
        time.sleep(0.001)
    tl.add("nvme_write", "tile 3", 1.0, 1.5, 4096)
    evs = tl.events()
    assert [e.lane for e in evs] == ["nvme_write", "forward"]  # sorted by start time
    assert evs[0].nbytes == 4096 and evs[0].duration == pytest.approx(0.5)
    assert evs[1].duration > 0


def test_bad_lane_and_reversed_interval_raise():
    tl = Timeline(enabled=True)
    with pytest.raises(ValueError, match="unknown lane"):
        tl.add("nvme", "x", 0, 1)
    with pytest.raises(ValueError, match="ends before it starts"):
        tl.add("h2d", "x", 2.0, 1.0)


def test_concurrent_adds_are_all_recorded():
    tl = Timeline(enabled=True)
    n_threads, per = 8, 2000
    start = threading.Barrier(n_threads)

    def worker(k):
        start.wait()
        for i in range(per):
            t = float(i)
            tl.add(LANES[k % len(LANES)], f"t{k}", t, t + 0.5, 1)
            tl.count("prefetched")

    th = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert len(tl) == n_threads * per
    assert tl.counters()["prefetched"] == n_threads * per
    assert sum(e.nbytes for e in tl.events()) == n_threads * per


def test_max_events_drops_and_counts():
    tl = Timeline(enabled=True, max_events=5)
    for i in range(8):
        tl.add("h2d", "x", i, i + 1, 1)
    assert len(tl) == 5 and tl.dropped == 3


def test_session_enables_then_disables_and_diffs_stats(tmp_path):
    tl = Timeline()
    counts = {"prefetch": {"hits": 10, "misses": 5}, "bytes": {"nvme_read": 0}}

    def stats():
        return counts

    with ProfileSession(tl, tmp_path / "p", stats_fn=stats) as prof:
        assert tl.enabled
        t = time.perf_counter()
        tl.add("nvme_read", "a", t, t + 0.01, 10_000_000)
        counts = {"prefetch": {"hits": 16, "misses": 7}, "bytes": {"nvme_read": 10_000_000}}
    assert not tl.enabled
    p = prof.summary["prefetch"]
    assert (p["prefetched"], p["on_demand"]) == (6, 2)
    assert p["hit_rate"] == pytest.approx(0.75)
    assert (tmp_path / "p" / "trace.json").is_file()
    # a session cannot be nested on the same timeline
    tl.enable()
    with pytest.raises(RuntimeError, match="already"):
        with ProfileSession(tl):
            pass


def test_session_writes_even_when_block_raises(tmp_path):
    tl = Timeline()
    with pytest.raises(KeyError):
        with ProfileSession(tl, tmp_path / "q"):
            t = time.perf_counter()
            tl.add("d2h", "g", t, t + 0.001, 1000)
            raise KeyError("boom")
    assert (tmp_path / "q" / "summary.json").is_file()
