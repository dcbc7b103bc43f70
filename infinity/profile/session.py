"""``ProfileSession``: the context manager behind ``engine.profile(dir)`` and ``--profile DIR``.

    with ProfileSession(timeline, "prof/", stats_fn=engine.stats) as prof:
        for batch in data: ...
    prof.summary["bottleneck"]["sentence"]

On enter the timeline is cleared and enabled; on exit it is disabled and, when
``dir`` is given, its outputs are written there. ``stats_fn`` (optional) returns a
dict of plain numbers, e.g. ``engine.stats()``; it is called on enter and on exit and
the *difference* of its numeric prefetch counters (``prefetched``/``on_demand``, see
docs/profiling.md) gives the prefetch hit rate of the profiled steps only.
If the block raises, outputs are still written (a profile of a failing step is
useful) and the exception propagates.
"""
import logging
import numbers

log = logging.getLogger("infinity.profile")


def _flatten(d, prefix=""):
    out = {}
    if not isinstance(d, dict):
        return out
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, numbers.Number) and not isinstance(v, bool):
            out[key] = v
    return out


def stats_delta(before, after):
    """Numeric leaves of ``after`` minus ``before`` (flattened ``a.b`` keys), plus
    un-prefixed copies of ``prefetch.*`` keys so ``prefetch.hits`` is found as ``hits``."""
    b, a = _flatten(before), _flatten(after)
    out = {k: v - b.get(k, 0) for k, v in a.items()}
    for k, v in list(out.items()):
        leaf = k.rsplit(".", 1)[-1]
        out.setdefault(leaf, v)
    return out


class ProfileSession:
    def __init__(self, timeline, dir=None, stats_fn=None, *, ceilings=None, plot=True, note=None):
        self.timeline = timeline
        self.dir = dir
        self.stats_fn = stats_fn
        self.ceilings = ceilings
        self.plot = plot
        self.note = note          # e.g. "step 1 skipped as warm-up": shown with the steps covered
        self.summary = None
        self.paths = None
        self._before = None

    def __enter__(self):
        if self.timeline.enabled:
            raise RuntimeError("a profile is already being recorded on this timeline; "
                               "profiling sessions cannot nest")
        self.timeline.clear()
        self._before = self.stats_fn() if self.stats_fn else None
        self.timeline.enable()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.timeline.disable()
        counters = None
        if self.stats_fn:
            try:
                counters = stats_delta(self._before or {}, self.stats_fn())
            except Exception as e:  # the profile is still worth writing
                log.warning("profile: stats_fn failed (%s: %s); no prefetch counters",
                            type(e).__name__, e)
        if self.dir is not None:
            try:
                self.paths = self.timeline.write(self.dir, ceilings=self.ceilings,
                                                 counters=counters, plot=self.plot, note=self.note)
                self.summary = self.paths["summary"]
            except Exception:
                if exc_type is None:
                    raise
                log.exception("profile: writing outputs to %s failed while handling %s",
                              self.dir, exc_type.__name__)
        else:
            self.summary = self.timeline.summary(ceilings=self.ceilings, counters=counters,
                                                 note=self.note)
        return False
