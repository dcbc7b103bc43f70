"""Chrome-trace / Perfetto JSON export of a timeline.

Open the file in https://ui.perfetto.dev or chrome://tracing. One process per rank
(``pid`` = rank), one thread per lane (``tid`` = lane index, named by ``thread_name``
metadata), "X" complete events with ``ts``/``dur`` in microseconds relative to the
start of the profile window, bytes and GB/s in ``args``, and step boundaries as
global instant events.
"""
from .lanes import LANES


def trace_dict(timeline):
    """The Chrome-trace object (``{"traceEvents": [...], ...}``) of ``timeline``."""
    lo, hi = timeline.window()
    pid = timeline.rank
    tids = {lane: i + 1 for i, lane in enumerate(LANES)}
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": f"infinity rank {pid}"}}]
    for lane, tid in tids.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": tid}})
    if lo is None:
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"producer": "infinity.profile", "window_s": 0.0}}
    for e in timeline.events():
        dur_us = (e.t1 - e.t0) * 1e6
        args = {}
        if e.nbytes:
            args["bytes"] = e.nbytes
            if e.t1 > e.t0:
                args["GB/s"] = round(e.nbytes / (e.t1 - e.t0) / 1e9, 4)
        events.append({"ph": "X", "name": e.name, "cat": e.lane, "pid": pid, "tid": tids[e.lane],
                       "ts": round((e.t0 - lo) * 1e6, 3), "dur": round(dur_us, 3), "args": args})
    for step, t in timeline.steps():
        events.append({"ph": "i", "s": "g", "name": f"step {step}", "cat": "step", "pid": pid,
                       "tid": 0, "ts": round((t - lo) * 1e6, 3), "args": {"step": step}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "infinity.profile", "window_s": hi - lo,
                          "dropped_events": timeline.dropped}}
