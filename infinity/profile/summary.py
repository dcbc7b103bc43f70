"""What a timeline means: achieved GB/s per link, waits per layer, prefetch hit rate, bottleneck.

Definitions (also in docs/profiling.md):

- *window*: from the first step mark / event / ``enable()`` to the last event end /
  step mark / ``disable()`` (:meth:`Timeline.window`). "Step time" below is this window.
- *busy time* of a lane: the length of the union of its intervals clipped to the window,
  so two overlapping reads (several requests in flight) count once.
- *achieved GB/s* of a link: bytes moved on the lane / busy time (10^9 bytes per second):
  the bandwidth while the link was in use. *Effective GB/s* is bytes / window.
- *compute*: union of forward, backward and optimizer intervals minus the union of
  ``wait`` intervals (a forward span that includes a wait for its parameters counts the
  wait as waiting, not computing).
- *exposed time* of a link: its busy time that does not overlap compute. Transfers hidden
  under compute (prefetch working) cannot lengthen the step; exposed ones can.
- *bottleneck*: the candidate with the largest fraction of the window among compute (its
  busy time) and the six links (their exposed time). If the time in which nothing at all
  was recorded (idle: no lane busy) is larger, the step is *overhead-bound* (Python,
  allocation, synchronisation not covered by any lane). Ties go to the link (I/O is what
  offload tuning can change). Without compute spans, exposed = busy.
"""
import json
import logging
import os

from .lanes import COMPUTE_LANES, LANES, LINK_LANES, WAIT_LANE

log = logging.getLogger("infinity.profile")

LANE_LABELS = {
    "nvme_read": "NVMe-read", "nvme_write": "NVMe-write", "h2d": "H2D", "d2h": "D2H",
    "allgather": "all-gather", "reduce_scatter": "reduce-scatter",
    "forward": "forward", "backward": "backward", "optimizer": "optimizer", "wait": "wait",
    "activations": "activations",
    "compute": "compute", "overhead": "overhead",
}

# Counter names understood as prefetch hits / on-demand fetches (timeline counters or stats).
_HIT_KEYS = ("prefetched", "prefetched_fetches", "prefetch_hits", "prefetch_hit", "fetch_prefetched")
_MISS_KEYS = ("on_demand", "on_demand_fetches", "prefetch_misses", "prefetch_miss", "fetch_on_demand")


# ---------------------------------------------------------------------- interval algebra
def merge_intervals(intervals):
    """Union of ``[(t0, t1)]`` as a sorted list of disjoint intervals."""
    out = []
    for t0, t1 in sorted(intervals):
        if out and t0 <= out[-1][1]:
            if t1 > out[-1][1]:
                out[-1][1] = t1
        else:
            out.append([t0, t1])
    return [(a, b) for a, b in out]


def clip_intervals(intervals, lo, hi):
    out = []
    for t0, t1 in intervals:
        a, b = max(t0, lo), min(t1, hi)
        if b > a:
            out.append((a, b))
    return out


def clip_sorted(intervals, lo, hi):
    """``clip_intervals`` for sorted disjoint intervals (``merge_intervals`` output), O(log n + k)."""
    import bisect
    i = max(0, bisect.bisect_right(intervals, (lo, float("inf"))) - 1)
    out = []
    for a, b in intervals[i:]:
        if a >= hi:
            break
        a, b = max(a, lo), min(b, hi)
        if b > a:
            out.append((a, b))
    return out


def total_length(intervals):
    """Length of the union of the intervals."""
    return _length(merge_intervals(intervals))


def _length(disjoint):
    return sum(b - a for a, b in disjoint)


def subtract_intervals(base, minus):
    """``union(base) \\ union(minus)`` as disjoint intervals."""
    base = merge_intervals(base)
    minus = merge_intervals(minus)
    out = []
    j = 0
    for a, b in base:
        cur = a
        while j < len(minus) and minus[j][1] <= cur:
            j += 1
        k = j
        while k < len(minus) and minus[k][0] < b:
            m0, m1 = minus[k]
            if m0 > cur:
                out.append((cur, m0))
            cur = max(cur, m1)
            if cur >= b:
                break
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


# ---------------------------------------------------------------------- ceilings
def load_ceilings(ceilings):
    """Normalise ``ceilings`` to ``{"nvme_read": GB/s, "nvme_write": GB/s}`` (keys optional).

    Accepts a dict with lane keys (``nvme_read``/``nvme_write``) or bench-io keys
    (``read_gbps``/``write_gbps``), or the path of a JSON file saved by
    ``infinity bench-io --sweep --save FILE``: every ``read_gbps``/``write_gbps`` found
    anywhere in it is considered and the best (largest) is the ceiling.
    """
    if ceilings is None:
        return {}
    if isinstance(ceilings, (str, os.PathLike)):
        path = os.fspath(ceilings)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise OSError(e.errno, f"cannot read the bench-io ceilings file {path!r}: {e.strerror}; "
                          "save one with `infinity bench-io --sweep --save FILE`") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"bench-io ceilings file {path!r} is not valid JSON ({e}); "
                             "save one with `infinity bench-io --sweep --save FILE`") from e
        found = {"read_gbps": [], "write_gbps": []}
        _collect_gbps(data, found)
        out = {}
        if found["read_gbps"]:
            out["nvme_read"] = max(found["read_gbps"])
        if found["write_gbps"]:
            out["nvme_write"] = max(found["write_gbps"])
        if not out:
            log.warning("bench-io file %s has no read_gbps/write_gbps values; "
                        "the summary will have no ceilings", path)
        return out
    if isinstance(ceilings, dict):
        out = {}
        for k, v in ceilings.items():
            lane = {"read_gbps": "nvme_read", "write_gbps": "nvme_write"}.get(k, k)
            if lane not in LINK_LANES:
                raise ValueError(f"ceilings: unknown link {k!r}; use one of {', '.join(LINK_LANES)} "
                                 "(or read_gbps/write_gbps)")
            if v is None:
                continue
            v = float(v)
            if not v > 0:
                raise ValueError(f"ceilings[{k!r}] must be a positive GB/s value, got {v!r}")
            out[lane] = v
        return out
    raise TypeError(f"ceilings must be None, a dict of GB/s per link or a bench-io JSON path, "
                    f"got {type(ceilings).__name__}")


def _collect_gbps(obj, found):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in found and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                found[k].append(float(v))
            else:
                _collect_gbps(v, found)
    elif isinstance(obj, list):
        for v in obj:
            _collect_gbps(v, found)


# ---------------------------------------------------------------------- prefetch
def prefetch_counts(counters):
    """``(hits, misses)`` from a counter dict (flat, or nested under ``"prefetch"``), or None."""
    if not counters:
        return None
    flat = dict(counters)
    nested = counters.get("prefetch") if isinstance(counters, dict) else None
    if isinstance(nested, dict):
        for k, v in nested.items():
            flat.setdefault(k, v)
            flat.setdefault("prefetch_" + k, v)
    hits = next((flat[k] for k in _HIT_KEYS + ("hits",) if isinstance(flat.get(k), (int, float))), None)
    miss = next((flat[k] for k in _MISS_KEYS + ("misses",) if isinstance(flat.get(k), (int, float))), None)
    if hits is None and miss is None:
        return None
    return int(hits or 0), int(miss or 0)


# ---------------------------------------------------------------------- the summary
def _lane_stats(events, lo, hi):
    by_lane = {}
    for e in events:
        by_lane.setdefault(e.lane, []).append(e)
    per_lane = {}
    for lane in LANES:
        evs = by_lane.get(lane)
        if not evs:
            continue
        iv = clip_intervals([(e.t0, e.t1) for e in evs], lo, hi)
        per_lane[lane] = {"events": len(evs), "bytes": sum(e.nbytes for e in evs),
                          "intervals": merge_intervals(iv)}
    return per_lane


def _busy(per_lane, lanes):
    iv = []
    for lane in lanes:
        if lane in per_lane:
            iv.extend(per_lane[lane]["intervals"])
    return merge_intervals(iv)


def _bottleneck(fractions, idle_fraction):
    """Pick the bottleneck among links + compute; see the module docstring."""
    cands = [(f, 1 if lane in LINK_LANES else 0, lane) for lane, f in fractions.items()]
    if not cands:
        return "overhead", idle_fraction
    f, _, lane = max(cands)
    if idle_fraction > f:
        return "overhead", idle_fraction
    return lane, f


#: a link busy at least this fraction of the step is named next to a compute-bound headline
#: (hidden under compute, it is the bound once compute gets faster)
BUSY_LINK_NOTE = 0.5


def bottleneck_sentence(lane, fraction, busy_links=None):
    """The headline; ``busy_links`` (lane -> busy fraction) names the busiest link next to a
    compute-bound step when it is busy >= :data:`BUSY_LINK_NOTE` of the step."""
    pct = round(100 * fraction)
    if lane == "overhead":
        return (f"step is overhead-bound: {pct} % of step time no link or compute lane was busy "
                "(Python, allocation or synchronisation outside the recorded spans)")
    if lane == "compute":
        out = f"step is compute-bound: {pct} % of step time"
        if busy_links:
            link, busy = max(busy_links.items(), key=lambda kv: (kv[1], kv[0]))
            if busy >= BUSY_LINK_NOTE:
                out += (f" ({LANE_LABELS[link]} busy {round(100 * busy)} % of it, hidden under "
                        "compute: the next bound)")
        return out
    return f"step is {LANE_LABELS[lane]} bound: {pct} % of step time"


def steps_covered(timeline):
    """``{"first": a, "last": b, "count": n}`` of the step marks in the window, or None."""
    lo, hi = timeline.window()
    if lo is None:
        return None
    marks = [s for s, t in timeline.steps() if lo <= t <= hi]
    if not marks:
        return None
    return {"first": marks[0], "last": marks[-1], "count": len(marks)}


def summarize(timeline, *, ceilings=None, counters=None, note=None):
    """Summary dict of a :class:`Timeline` (JSON-serialisable). See the module docstring.
    ``note``: what the caller left out of the window (e.g. warm-up steps), shown with the
    steps the profile covers."""
    lo, hi = timeline.window()
    ceil = load_ceilings(ceilings)
    all_counters = dict(timeline.counters())
    for k, v in (counters or {}).items():
        all_counters[k] = v
    out = {"window_s": 0.0, "events": len(timeline), "dropped_events": timeline.dropped,
           "links": {}, "compute": {}, "wait": {"total_s": 0.0, "fraction": 0.0, "by_layer": []},
           "prefetch": None, "bottleneck": {"lane": None, "fraction": 0.0,
                                            "sentence": "nothing was recorded"},
           "steps": [], "ceilings_gbps": ceil, "covers": steps_covered(timeline), "note": note}
    pc = prefetch_counts(all_counters)
    if pc is not None:
        hits, miss = pc
        out["prefetch"] = {"prefetched": hits, "on_demand": miss,
                           "hit_rate": (hits / (hits + miss)) if hits + miss else None}
    if lo is None or hi <= lo:
        return out
    wall = hi - lo
    events = timeline.events()
    per_lane = _lane_stats(events, lo, hi)
    out["window_s"] = wall

    fractions = {}
    for lane in LINK_LANES:
        if lane not in per_lane:
            continue
        st = per_lane[lane]
        busy = _length(st["intervals"])
        nbytes = st["bytes"]
        entry = {"bytes": nbytes, "events": st["events"], "busy_s": busy,
                 "busy_fraction": busy / wall,
                 "achieved_gbps": (nbytes / busy / 1e9) if busy > 0 else None,
                 "effective_gbps": nbytes / wall / 1e9,
                 "ceiling_gbps": ceil.get(lane),
                 "of_ceiling": None}
        if entry["achieved_gbps"] is not None and lane in ceil:
            entry["of_ceiling"] = entry["achieved_gbps"] / ceil[lane]
        # the runtime's own byte counter over the same period (engine.stats() via
        # ProfileSession): a mismatch means some transfers were not put on the timeline
        cb = all_counters.get(f"{lane}_bytes")
        if isinstance(cb, (int, float)) and not isinstance(cb, bool):
            entry["counter_bytes"] = int(cb)
        out["links"][lane] = entry

    wait_iv = _busy(per_lane, (WAIT_LANE,))
    compute_iv = subtract_intervals(_busy(per_lane, COMPUTE_LANES), wait_iv)
    for lane in COMPUTE_LANES:
        if lane in per_lane:
            iv = subtract_intervals(per_lane[lane]["intervals"], wait_iv)
            busy = _length(iv)
            out["compute"][lane] = {"events": per_lane[lane]["events"], "busy_s": busy,
                                    "busy_fraction": busy / wall}
    if compute_iv:
        busy = _length(compute_iv)
        out["compute"]["total"] = {"busy_s": busy, "busy_fraction": busy / wall}
        fractions["compute"] = busy / wall
    for lane, entry in out["links"].items():
        exposed = _length(subtract_intervals(per_lane[lane]["intervals"], compute_iv))
        entry["exposed_s"] = exposed
        entry["exposed_fraction"] = exposed / wall
        fractions[lane] = exposed / wall

    if WAIT_LANE in per_lane:
        by_layer = {}
        for e in events:
            if e.lane != WAIT_LANE:
                continue
            d = by_layer.setdefault(e.name, {"layer": e.name, "wait_s": 0.0, "count": 0})
            d["wait_s"] += max(0.0, min(e.t1, hi) - max(e.t0, lo))
            d["count"] += 1
        wtot = _length(wait_iv)
        out["wait"] = {"total_s": wtot, "fraction": wtot / wall,
                       "by_layer": sorted(by_layer.values(), key=lambda d: -d["wait_s"])}

    anything = total_length([iv for st in per_lane.values() for iv in st["intervals"]])
    idle_fraction = max(0.0, 1.0 - anything / wall)
    out["idle_fraction"] = idle_fraction
    lane, frac = _bottleneck(fractions, idle_fraction)
    busy_links = {k: e["busy_fraction"] for k, e in out["links"].items()}
    out["bottleneck"] = {"lane": lane, "fraction": frac,
                         "sentence": bottleneck_sentence(lane, frac, busy_links),
                         "fractions": fractions}
    out["steps"] = _per_step(timeline, per_lane, wait_iv, lo, hi)
    return out


def _per_step(timeline, per_lane, wait_iv, lo, hi):
    """Rows for the segments between step marks: one per mark (from it to the next mark or
    the end of the window, ``"step"`` = the mark's label) plus, when the window starts
    before the first mark, a leading row with ``"step": None`` and ``"before_step"``.
    Segments shorter than 0.1 % of the window (e.g. a mark at the very end) are omitted."""
    marks = [(s, t) for s, t in timeline.steps() if lo <= t <= hi]
    if not marks:
        return []
    eps = 1e-3 * (hi - lo)
    segs = []
    if marks[0][1] - lo > eps:
        segs.append((None, marks[0][0], lo, marks[0][1]))
    bounds = [t for _, t in marks] + [hi]
    for i, (step, t0) in enumerate(marks):
        segs.append((step, None, t0, bounds[i + 1]))
    comp = subtract_intervals(_busy(per_lane, COMPUTE_LANES), wait_iv)
    rows = []
    for step, before, t0, t1 in segs:
        if t1 - t0 <= eps:
            continue
        wall = t1 - t0
        row = {"step": step, "time_s": wall, "busy_fraction": {}}
        if before is not None:
            row["before_step"] = before
        for lane in LINK_LANES:
            if lane in per_lane:
                row["busy_fraction"][lane] = sum(
                    b - a for a, b in clip_sorted(per_lane[lane]["intervals"], t0, t1)) / wall
        row["busy_fraction"]["compute"] = sum(b - a for a, b in clip_sorted(comp, t0, t1)) / wall
        rows.append(row)
    return rows


def _covers_text(c, count=True):
    if not c:
        return ""
    if c["first"] == c["last"]:
        return f"step {c['first']}"
    return f"steps {c['first']}-{c['last']}" + (f" ({c['count']} step marks)" if count else "")


def format_summary(s):
    """Human-readable text of a summary dict (what ``summary.txt`` holds)."""
    lines = [f"Profile of {s['window_s']:.3f} s ({s['events']} events"
             + (f", {s['dropped_events']} dropped" if s.get("dropped_events") else "") + ")"]
    covers = _covers_text(s.get("covers"))
    if covers or s.get("note"):
        lines.append("Covers: " + "; ".join(x for x in (covers, s.get("note")) if x))
    lines += [f"Bottleneck: {s['bottleneck']['sentence']}", ""]
    if s["links"]:
        lines.append(f"{'link':<15}{'bytes':>14}{'busy s':>10}{'busy %':>8}{'exposed %':>11}{'GB/s':>9}"
                     f"{'ceiling':>9}{'of ceil':>9}")
        for lane, e in s["links"].items():
            ach = f"{e['achieved_gbps']:.3f}" if e["achieved_gbps"] is not None else "-"
            cg = f"{e['ceiling_gbps']:.3f}" if e["ceiling_gbps"] else "-"
            oc = f"{100 * e['of_ceiling']:.0f} %" if e["of_ceiling"] is not None else "-"
            lines.append(f"{LANE_LABELS[lane]:<15}{e['bytes']:>14,}{e['busy_s']:>10.3f}"
                         f"{100 * e['busy_fraction']:>7.1f}%{100 * e['exposed_fraction']:>10.1f}%"
                         f"{ach:>9}{cg:>9}{oc:>9}")
        lines.append("  GB/s = bytes / busy time (union of overlapping transfers); exposed = busy time "
                     "not hidden under compute; ceiling from `infinity bench-io --sweep`")
        for lane, e in s["links"].items():
            cb = e.get("counter_bytes")
            if cb is not None and cb != e["bytes"]:
                lines.append(f"  note: {LANE_LABELS[lane]}: the runtime counted {cb:,} bytes, the "
                             f"timeline {e['bytes']:,}: some transfers are not recorded as spans")
    else:
        lines.append("no link activity recorded")
    lines.append("")
    if s["compute"]:
        parts = [f"{k} {v['busy_s']:.3f} s ({100 * v['busy_fraction']:.1f} %)"
                 for k, v in s["compute"].items()]
        lines.append("Compute: " + ", ".join(parts))
    w = s["wait"]
    lines.append(f"Compute waited on I/O: {w['total_s']:.3f} s ({100 * w['fraction']:.1f} % of step time)")
    for d in w["by_layer"][:20]:
        lines.append(f"  {d['layer']:<40} {d['wait_s']:.4f} s over {d['count']} wait(s)")
    if len(w["by_layer"]) > 20:
        lines.append(f"  ... {len(w['by_layer']) - 20} more layers in summary.json")
    p = s.get("prefetch")
    if p is None:
        lines.append("Prefetch hit rate: not reported (no prefetch counters)")
    elif p["hit_rate"] is None:
        lines.append("Prefetch hit rate: no fetches counted")
    else:
        span = _covers_text(s.get("covers"), count=False)
        over = f" over {span}" if span else ""
        lines.append(f"Prefetch hit rate: {100 * p['hit_rate']:.1f} %{over} "
                     f"({p['prefetched']} prefetched, {p['on_demand']} on demand)")
    if s["steps"]:
        lines.append("")
        lines.append("Between step marks: " + "; ".join(
            (f"before step {r['before_step']}" if r["step"] is None else f"from step {r['step']}")
            + f" {r['time_s']:.3f} s" for r in s["steps"]))
    return "\n".join(lines) + "\n"
