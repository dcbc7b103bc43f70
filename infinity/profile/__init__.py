"""Offload-bandwidth profiling: a timeline of every link and compute lane, and its outputs.

    from infinity.profile import Timeline, ProfileSession
    tl = Timeline()                       # disabled: every call is a cheap no-op
    with ProfileSession(tl, "prof/"):     # enables, then writes trace.json, timeline.png,
        ...                               # summary.json, summary.txt
    # inside the runtime:
    with tl.span("nvme_read", "layers.3", nbytes=n): ...
    tl.add("h2d", "layers.3", t0, t1, nbytes)
    tl.mark_step(step)

See docs/profiling.md for the definitions (busy time, GB/s, bottleneck).
"""
from .timeline import (COMPUTE_LANES, DISABLED, LANES, LINK_LANES, WAIT_LANE, Event, Timeline,
                       as_timeline)
from .session import ProfileSession


def __getattr__(name):
    # heavier pieces (summary maths, matplotlib) load on first use only
    if name in ("summarize", "format_summary", "load_ceilings", "merge_intervals", "total_length"):
        from . import summary
        return getattr(summary, name)
    raise AttributeError(f"module 'infinity.profile' has no attribute {name!r}")


__all__ = ["Timeline", "ProfileSession", "Event", "LANES", "LINK_LANES", "COMPUTE_LANES",
           "WAIT_LANE", "DISABLED", "as_timeline", "summarize", "format_summary", "load_ceilings"]
