"""PNG timeline plot: one horizontal lane per link and compute, x in seconds.

Uses matplotlib's object API with the Agg canvas (no pyplot global state, safe off
the main thread and without a display). Each lane draws the union of its intervals
(overlapping in-flight requests merge into one bar), step ends are vertical lines
labelled on their left (over the step they close), and the title carries the bottleneck sentence. Step labels that would overlap
(many short steps) are thinned: each step keeps its line, every label stays legible.
"""
from .lanes import LANES
from .summary import LANE_LABELS, clip_intervals, merge_intervals

LANE_COLORS = {
    "nvme_read": "#1f77b4", "nvme_write": "#aec7e8", "h2d": "#2ca02c", "d2h": "#98df8a",
    "allgather": "#9467bd", "reduce_scatter": "#c5b0d5", "forward": "#ff7f0e",
    "backward": "#d62728", "optimizer": "#8c564b", "activations": "#17becf",
    "wait": "#7f7f7f",
}


def plot_timeline(timeline, path, *, title=None, dpi=110):
    """Write the PNG to ``path``; returns ``path``. Lanes without events are omitted."""
    fig = build_figure(timeline, title=title, dpi=dpi)
    fig.savefig(path, format="png")
    return path


def _thin_labels(fig, labels, gap_px=3):
    """Hide step labels that would overlap the previous visible one (they are drawn left to
    right; every step keeps its dashed line). Needs the final layout, so call it last."""
    renderer = fig.canvas.get_renderer()
    right = None
    for t in labels:
        bb = t.get_window_extent(renderer)
        if right is not None and bb.x0 < right + gap_px:
            t.set_visible(False)
        else:
            right = bb.x1


def build_figure(timeline, *, title=None, dpi=110):
    """The timeline as a matplotlib ``Figure`` (Agg canvas); step labels never overlap."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    lo, hi = timeline.window()
    events = timeline.events()
    by_lane = {}
    for e in events:
        by_lane.setdefault(e.lane, []).append((e.t0, e.t1))
    lanes = [lane for lane in LANES if lane in by_lane]
    height = 1.2 + 0.45 * max(1, len(lanes))
    fig = Figure(figsize=(12, height), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    if lo is None or not lanes:
        ax.text(0.5, 0.5, "nothing was recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    else:
        n = len(lanes)
        for i, lane in enumerate(lanes):
            y = n - 1 - i  # first lane on top
            iv = merge_intervals(clip_intervals(by_lane[lane], lo, hi))
            # at ~1300 px across, gaps and bars narrower than 1/4000 of the window are
            # invisible: coalesce them (keeps big profiles fast) and give each bar a minimum width
            min_w = (hi - lo) / 4000.0
            bars = []
            for a, b in iv:
                if bars and a - lo - (bars[-1][0] + bars[-1][1]) <= min_w:
                    bars[-1][1] = max(bars[-1][1], b - lo - bars[-1][0])
                else:
                    bars.append([a - lo, b - a])
            bars = [(a, max(w, min_w)) for a, w in bars]
            ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=LANE_COLORS[lane], linewidth=0)
        ax.set_yticks(range(n))
        ax.set_yticklabels([LANE_LABELS[lane] for lane in reversed(lanes)])
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_xlim(0, hi - lo)
        for step, t in timeline.steps():
            if lo <= t <= hi:
                ax.axvline(t - lo, color="black", linewidth=0.8, linestyle="--", alpha=0.7)
                # the engine marks the END of a step: the label sits left of its line,
                # over the step it closes
                labels.append(ax.text(t - lo, n - 0.45, f"step {step} ", fontsize=7, va="bottom",
                                      ha="right"))
    ax.set_xlabel("seconds since the start of the profile")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    _thin_labels(fig, labels)
    return fig
