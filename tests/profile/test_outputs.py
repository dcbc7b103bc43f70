"""Outputs on disk: valid Chrome-trace JSON with the expected lanes, a real PNG, summaries."""
import json

import pytest

from infinity.profile import LANES, Timeline


def synthetic():
    tl = Timeline(enabled=True, rank=0)
    base = 100.0
    tl.add("nvme_read", "layers.0", base + 0.0, base + 0.4, 400_000_000)
    tl.add("h2d", "layers.0", base + 0.4, base + 0.5, 100_000_000)
    tl.add("forward", "layers.0", base + 0.5, base + 0.6)
    tl.add("wait", "layers.1", base + 0.6, base + 0.7)
    tl.add("backward", "layers.0", base + 0.7, base + 0.9)
    tl.add("d2h", "layers.0", base + 0.9, base + 0.95, 50_000_000)
    tl.add("optimizer", "tile 0", base + 0.95, base + 1.0)
    tl.add("nvme_write", "tile 0", base + 0.95, base + 1.1, 120_000_000)
    tl.add("allgather", "g0", base + 0.3, base + 0.35, 1000)
    tl.add("reduce_scatter", "g0", base + 0.8, base + 0.85, 1000)
    tl.add("activations", "pack nvme", base + 0.55, base + 0.56, 4096)
    with tl._lock:
        tl._steps.extend([(1, base), (2, base + 0.6)])
    tl.enabled = False
    return tl


def test_chrome_trace_lanes_and_units(tmp_path):
    out = synthetic().write(tmp_path / "new" / "dir", ceilings={"nvme_read": 2.0})
    trace = json.loads(open(out["trace"]).read())
    evs = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names) == set(LANES)
    x = [e for e in evs if e["ph"] == "X"]
    assert len(x) == 11
    by_lane = {e["cat"]: e for e in x}
    assert set(by_lane) == set(LANES)
    r = by_lane["nvme_read"]
    assert r["ts"] == pytest.approx(0.0) and r["dur"] == pytest.approx(400_000.0)  # microseconds
    assert r["args"]["bytes"] == 400_000_000 and r["args"]["GB/s"] == pytest.approx(1.0)
    assert r["tid"] == names["nvme_read"]
    assert by_lane["forward"]["ts"] == pytest.approx(500_000.0)
    steps = [e for e in evs if e["ph"] == "i"]
    assert [e["name"] for e in steps] == ["step 1", "step 2"]
    for e in x:
        assert set(("name", "ph", "ts", "dur", "pid", "tid")) <= set(e)


def test_png_is_valid_image(tmp_path):
    out = synthetic().write(tmp_path)
    raw = open(out["plot"], "rb").read()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000
    import matplotlib.image as mpimg
    img = mpimg.imread(out["plot"])
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 500
    # not a blank canvas: the lane bars add colours other than white/black/grey
    px = img[..., :3].reshape(-1, 3)
    colourful = ((px.max(axis=1) - px.min(axis=1)) > 0.2).mean()
    assert colourful > 0.01


def test_summary_files(tmp_path):
    out = synthetic().write(tmp_path, ceilings={"read_gbps": 2.0, "write_gbps": 1.0})
    s = json.loads(open(out["summary_json"]).read())
    assert s["links"]["nvme_read"]["achieved_gbps"] == pytest.approx(1.0)
    assert s["links"]["nvme_read"]["of_ceiling"] == pytest.approx(0.5)
    assert s["links"]["nvme_write"]["of_ceiling"] == pytest.approx(0.8)
    assert s["bottleneck"]["lane"] == "nvme_read"
    txt = open(out["summary_txt"]).read()
    assert "step is NVMe-read bound: 36 % of step time" in txt
    assert "layers.1" in txt and "50 %" in txt


def test_nonzero_rank_gets_suffixed_files(tmp_path):
    tl = synthetic()
    tl.rank = 3
    out = tl.write(tmp_path, plot=False)
    assert out["trace"].endswith("trace-rank3.json") and out["plot"] is None
    trace = json.loads(open(out["trace"]).read())
    assert {e["pid"] for e in trace["traceEvents"]} == {3}


def test_unwritable_dir_gives_clear_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OSError, match="profile directory"):
        synthetic().write(f / "sub")


def test_failed_output_write_leaves_no_temp_file(tmp_path):
    from infinity.profile.writer import _atomic_write
    target = tmp_path / "summary.txt"
    with pytest.raises(UnicodeEncodeError):
        _atomic_write(str(target), "ok \udc80")     # a lone surrogate cannot be UTF-8 encoded
    assert list(tmp_path.iterdir()) == []
    _atomic_write(str(target), "fine")
    assert target.read_text() == "fine" and [p.name for p in tmp_path.iterdir()] == ["summary.txt"]


def test_step_labels_in_the_png_do_not_overlap():
    """40 short steps across the plot: every step keeps its line, the labels shown are legible
    (no two overlap), the first is shown, and short steps leave some labels out."""
    from infinity.profile.plot import build_figure
    tl = Timeline(enabled=True, rank=0)
    base = 50.0
    with tl._lock:
        tl._steps.extend([(i + 1, base + 0.05 * i) for i in range(40)])
    for i in range(40):
        tl.add("forward", "m", base + 0.05 * i, base + 0.05 * i + 0.03)
    tl.enabled = False
    fig = build_figure(tl)
    ax = fig.axes[0]
    r = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().strip().startswith("step")]
    assert len(labels) == 40 and len(ax.lines) == 40
    shown = [t for t in labels if t.get_visible()]
    assert shown[0] is labels[0] and 3 <= len(shown) < 40
    boxes = sorted((t.get_window_extent(r) for t in shown), key=lambda b: b.x0)
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 <= b.x0, (a, b)
    # a mark is the END of its step: each label sits left of its line, over that step
    for t in labels:
        x_line = ax.transData.transform((t.get_position()[0], 0))[0]
        bb = t.get_window_extent(r)
        assert bb.x1 <= x_line + 0.5 and bb.x0 < x_line, (t.get_text(), bb, x_line)
    # few long steps: every label is shown
    tl2 = synthetic()
    fig2 = build_figure(tl2)
    assert all(t.get_visible() for t in fig2.axes[0].texts)


def test_summary_names_the_steps_it_covers():
    from infinity.profile.summary import format_summary
    tl = synthetic()
    s = tl.summary(counters={"prefetched": 9, "on_demand": 1}, note="step 0 left out as warm-up")
    assert s["covers"] == {"first": 1, "last": 2, "count": 2}
    text = format_summary(s)
    assert "Covers: steps 1-2 (2 step marks); step 0 left out as warm-up" in text
    assert "Prefetch hit rate: 90.0 % over steps 1-2" in text
