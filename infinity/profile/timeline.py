"""The timeline: a thread-safe record of what every link and compute lane did, and when.

The engine, the NVMe optimizer step and the I/O completion threads call
:meth:`Timeline.add` or :meth:`Timeline.span`; the outputs (Chrome trace, PNG
plot, bandwidth summary) are derived from the recorded intervals by
:meth:`Timeline.write`.

A disabled timeline (the default) records nothing and costs one attribute
test per call: ``add`` returns at once and ``span`` returns a shared no-op
context manager, so call sites never need ``if timeline is not None and ...``
guards beyond passing ``timeline=None`` -> :data:`DISABLED`.
"""
import logging
import threading
import time

from .lanes import COMPUTE_LANES, LANES, LINK_LANES, WAIT_LANE  # noqa: F401 (re-exported)

log = logging.getLogger("infinity.profile")

#: Every lane a timeline accepts (infinity.profile.lanes), in display order.
_LANE_SET = frozenset(LANES)

#: Upper bound on recorded events; beyond it events are counted as dropped, not stored,
#: so a forgotten enabled timeline cannot grow without bound (~100 bytes per event).
DEFAULT_MAX_EVENTS = 2_000_000


class Event:
    """One recorded interval. ``t0``/``t1`` are ``time.perf_counter()`` seconds."""

    __slots__ = ("lane", "name", "t0", "t1", "nbytes", "thread")

    def __init__(self, lane, name, t0, t1, nbytes=0, thread=None):
        self.lane = lane
        self.name = name
        self.t0 = t0
        self.t1 = t1
        self.nbytes = nbytes
        self.thread = thread

    @property
    def duration(self):
        return self.t1 - self.t0

    def __repr__(self):
        return (f"Event({self.lane!r}, {self.name!r}, t0={self.t0:.6f}, t1={self.t1:.6f}, "
                f"nbytes={self.nbytes})")


class _NullSpan:
    """Shared no-op context manager returned by ``span`` on a disabled timeline."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class _Span:
    __slots__ = ("_tl", "_lane", "_name", "nbytes", "_t0")

    def __init__(self, tl, lane, name, nbytes):
        self._tl = tl
        self._lane = lane
        self._name = name
        self.nbytes = nbytes  # may be updated inside the block (e.g. bytes known only at the end)

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._tl.add(self._lane, self._name, self._t0, time.perf_counter(), self.nbytes)
        return False


class Timeline:
    """Records intervals per lane. See the module docstring.

    Parameters
    ----------
    enabled: start recording immediately (default False: every call is a no-op).
    rank: the data-parallel rank, used as the Chrome-trace process id and to
        suffix output file names on ranks other than 0.
    max_events: stop storing (and count as dropped) beyond this many events.
    """

    def __init__(self, enabled=False, *, rank=0, max_events=DEFAULT_MAX_EVENTS):
        self.enabled = bool(enabled)
        self.rank = int(rank)
        self.max_events = int(max_events)
        self._lock = threading.Lock()
        self._events = []
        self._steps = []          # [(step, t)]: step boundaries, in recording order
        self._counters = {}       # name -> number (e.g. prefetch hits / on-demand fetches)
        self.dropped = 0
        self.t_begin = None       # set by enable(); the window summaries start from
        self.t_end = None         # set by disable()

    # ------------------------------------------------------------------ recording
    def enable(self):
        """Start recording (the window begins now unless it already began)."""
        with self._lock:
            if self.t_begin is None:
                self.t_begin = time.perf_counter()
            self.t_end = None
            self.enabled = True
        return self

    def disable(self):
        """Stop recording; the window ends now. Recorded events are kept."""
        with self._lock:
            self.enabled = False
            self.t_end = time.perf_counter()
        return self

    def clear(self):
        """Forget every event, step mark and counter (keeps the enabled state)."""
        with self._lock:
            self._events = []
            self._steps = []
            self._counters = {}
            self.dropped = 0
            self.t_begin = time.perf_counter() if self.enabled else None
            self.t_end = None

    def add(self, lane, name, t0, t1, nbytes=0):
        """Record that ``lane`` was busy with ``name`` from ``t0`` to ``t1`` (perf_counter s).

        ``nbytes`` is what the interval moved (0 for compute). Safe to call from any thread.
        """
        if not self.enabled:
            return
        if lane not in _LANE_SET:
            raise ValueError(f"Timeline.add: unknown lane {lane!r} (name={name!r}); "
                             f"valid lanes: {', '.join(LANES)}")
        if t1 < t0:
            raise ValueError(f"Timeline.add: interval on lane {lane!r} ({name!r}) ends before it "
                             f"starts: t0={t0!r} > t1={t1!r}; pass time.perf_counter() values in order")
        ev = Event(lane, str(name), float(t0), float(t1), int(nbytes), threading.get_ident())
        with self._lock:
            if len(self._events) >= self.max_events:
                if self.dropped == 0:
                    log.warning("timeline full (%d events): further events are dropped; "
                                "profile fewer steps", self.max_events)
                self.dropped += 1
                return
            self._events.append(ev)

    def span(self, lane, name, nbytes=0):
        """``with tl.span("forward", "layers.3"): ...`` records the block's wall time.

        The returned object has a writable ``nbytes`` for sizes known only inside the block.
        """
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, lane, name, nbytes)

    def mark_step(self, step):
        """Mark an optimizer-step boundary labelled ``step`` (a vertical line in the plot).

        Per-step rows of the summary run from each mark to the next one (or the end of the
        window); the engine marks the end of each optimizer step with its step count."""
        if not self.enabled:
            return
        t = time.perf_counter()
        with self._lock:
            self._steps.append((int(step), t))

    def count(self, name, n=1):
        """Add ``n`` to counter ``name`` (e.g. ``"prefetched"``, ``"on_demand"``)."""
        if not self.enabled:
            return
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    # ------------------------------------------------------------------ reading
    def events(self, lane=None):
        """A snapshot list of recorded events (optionally of one lane), sorted by start time."""
        with self._lock:
            evs = list(self._events)
        if lane is not None:
            evs = [e for e in evs if e.lane == lane]
        evs.sort(key=lambda e: (e.t0, e.t1))
        return evs

    def steps(self):
        """Snapshot of step marks ``[(step, t)]`` sorted by time."""
        with self._lock:
            return sorted(self._steps, key=lambda s: s[1])

    def counters(self):
        with self._lock:
            return dict(self._counters)

    def __len__(self):
        with self._lock:
            return len(self._events)

    def window(self):
        """``(t_start, t_end)`` the summary covers.

        Starts at the earliest of: the first step mark, the first event, ``enable()``.
        Ends at the latest of: the last event end, the last step mark, ``disable()``.
        Returns ``(None, None)`` when nothing was recorded.
        """
        evs = self.events()
        steps = self.steps()
        starts = [e.t0 for e in evs[:1]] + [s[1] for s in steps[:1]]
        ends = [max(e.t1 for e in evs)] if evs else []
        ends += [s[1] for s in steps[-1:]]
        if self.t_begin is not None:
            starts.append(self.t_begin)
        if self.t_end is not None:
            ends.append(self.t_end)
        if not starts or not ends:
            return None, None
        return min(starts), max(ends)

    # ------------------------------------------------------------------ outputs
    def summary(self, *, ceilings=None, counters=None, note=None):
        """The bandwidth/bottleneck summary dict (see :func:`infinity.profile.summary.summarize`)."""
        from .summary import summarize
        return summarize(self, ceilings=ceilings, counters=counters, note=note)

    def write(self, dir, *, ceilings=None, counters=None, plot=True, note=None):
        """Write ``trace.json``, ``timeline.png``, ``summary.json`` and ``summary.txt`` into ``dir``.

        ``dir`` is created if missing. ``ceilings`` is ``{"nvme_read": GB/s, "nvme_write": GB/s}``
        or the path of a saved ``infinity bench-io --sweep --save FILE`` JSON. ``counters``
        adds to the timeline's own counters (e.g. prefetch hits from ``engine.stats()``).
        ``note`` says what the window leaves out (e.g. warm-up steps), printed with the steps
        it covers.
        Returns ``{"trace": path, "plot": path|None, "summary_json": path,
        "summary_txt": path, "summary": dict}``.
        """
        from .writer import write_outputs
        return write_outputs(self, dir, ceilings=ceilings, counters=counters, plot=plot, note=note)


#: A shared, permanently disabled timeline for call sites given ``timeline=None``.
class _DisabledTimeline(Timeline):
    def enable(self):
        raise RuntimeError("the shared DISABLED timeline cannot be enabled; "
                           "create your own infinity.profile.Timeline()")


DISABLED = _DisabledTimeline(enabled=False)


def as_timeline(timeline):
    """``None`` -> :data:`DISABLED`; a Timeline is returned unchanged."""
    return DISABLED if timeline is None else timeline
