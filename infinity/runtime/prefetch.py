"""Trace-based prefetch: record the order groups are used in one micro-step, then fetch
``depth`` groups ahead on later micro-steps.

A *use* is a request for a group's values: a module's forward pre-hook (forward or
recomputation) or the first unpack of a saved parameter view in backward.  Consecutive
repeats collapse.  While the live order matches the recorded trace the coordinator keeps
``depth`` upcoming groups in flight (bounded by the device budget); the first mismatch
makes the rest of that micro-step fetch on demand (one DEBUG line) and the new order
becomes the trace for the next micro-step.

Per-use bookkeeping is O(1) in the trace's length: the trace keeps each group's traced
positions, so "when is this group used next" is a bisection, never a scan of the rest of
the trace.

Note [Reuse within a micro-step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A group released while the trace uses it again later in the same micro-step (forward
then backward) stays resident when its next use is within the prefetch window, and,
with ``reuse_bytes`` > 0, beyond it too: up to ``reuse_bytes`` of such *kept* groups
(DeepSpeed's ``max_reuse_distance`` / ``max_live_parameters``).  At ZeRO stage 3 across
ranks this saves backward's all-gather (and the NVMe read of the shard) of every kept
group.  When the budget is full, the kept group needed furthest in the future is
released first (Belady); a prefetch that finds the device budget full releases kept
groups needed after it, an on-demand fetch prefetched or kept groups, the one needed
furthest ahead first.  Kept values cannot go stale: the
parameters change only in an optimizer step, and every kept group is released at the
end of its micro-step's backward (:meth:`end_pass`; a failed pass: the manager's
``abandon_all``; and, defensively, before every boundary step: :meth:`release_kept`
— a forward before step() drops the window anyway); an early (overlapped) step never
takes a group the trace uses again.
"""
from __future__ import annotations

import logging
from bisect import bisect_left

from infinity.memory.manager import MemoryManager
from infinity.memory.record import GroupRecord, Location

log = logging.getLogger("infinity.runtime")

__all__ = ["PrefetchCoordinator", "DEFAULT_REUSE_BYTES"]

#: bytes of released groups kept for their next use (Note [Reuse within a micro-step])
#: when ``prefetch.reuse_gb`` is unset and the device tier has no budget (a CPU-only rank)
DEFAULT_REUSE_BYTES = 10**9


class PrefetchCoordinator:
    def __init__(self, manager: MemoryManager, depth: int, accounting, reuse_bytes: int = 0):
        self.mm = manager
        self.depth = int(depth)
        self.acct = accounting
        self.reuse_bytes = int(reuse_bytes)
        self._kept: dict[int, int] = {}     # gid -> bytes of groups kept beyond the window
        self.trace: list[int] | None = None
        self._positions: dict[int, list[int]] = {}   # gid -> its positions in the trace
        self.recording: list[int] = []
        self._last_event = None
        self.cursor = 0
        self.divergent = False
        self.in_pass = False
        self.passes = 0
        self._by_gid = {g.gid: g for g in manager.groups}

    # ------------------------------------------------------------------ passes
    def begin_pass(self) -> None:
        """A training micro-step starts (forward with grad enabled)."""
        if self.in_pass:
            self.end_pass()
        self.in_pass = True
        self.recording = []
        self._last_event = None
        self.cursor = 0
        self.divergent = False
        self._prefetch_ahead()

    def end_pass(self) -> None:
        """The micro-step's backward finished: keep the order, drop unused prefetches."""
        if not self.in_pass:
            return
        self.in_pass = False
        self.passes += 1
        complete = self.trace is not None and not self.divergent and \
            self.cursor == len(self.trace)
        if not complete and self.recording:
            if self.trace is not None and not self.divergent:
                log.debug("prefetch: micro-step used %d of %d traced groups; re-recording",
                          self.cursor, len(self.trace))
            self._set_trace(list(self.recording))
        kept, self._kept = self._kept, {}
        for g in self.mm.groups:
            if g.prefetched and g.users == 0:
                self.mm.release(g)
                self.acct.count("reuse_unused" if g.gid in kept else "prefetch_unused")

    def abandon_pass(self) -> None:
        """The micro-step failed (Note [window abort]): keep the recorded trace as it
        was, forget this pass's progress and its prefetches' marks (the manager releases
        the groups)."""
        self.in_pass = False
        self.recording = []
        self._last_event = None
        self.cursor = 0
        self.divergent = False
        self._kept = {}
        for g in self.mm.groups:
            g.prefetched = False

    def _set_trace(self, trace: list[int]) -> None:
        self.trace = trace
        positions: dict[int, list[int]] = {}
        for i, gid in enumerate(trace):
            positions.setdefault(gid, []).append(i)
        self._positions = positions

    def _next_use(self, gid: int) -> int | None:
        """Position of the next traced use of ``gid`` at or after the cursor (None: no
        further use in the trace)."""
        pos = self._positions.get(gid)
        if not pos:
            return None
        k = bisect_left(pos, self.cursor)
        return pos[k] if k < len(pos) else None

    # ------------------------------------------------------------------ queries
    def recorded_uses(self) -> list[int]:
        """The group ids used so far in this micro-step, in order (read only)."""
        return self.recording

    def may_use_again(self, g: GroupRecord) -> bool:
        """Whether ``g`` may be used again in this micro-step: the order diverged from the
        trace (anything may come), or the trace uses ``g`` at or after the cursor (Note
        [Overlap safety] in infinity/engine/overlap.py)."""
        if self.divergent:
            return True
        return self.trace is not None and self._next_use(g.gid) is not None

    # ------------------------------------------------------------------ uses
    def use(self, g: GroupRecord, *, track: bool = True, kind: str = "module") -> None:
        """Make ``g`` resident (blocking) and keep the prefetch window full.
        ``kind``: "module" (a module call: always one trace event) or "unpack" (saved
        views unpacked in backward: back-to-back repeats are one event)."""
        if track and self.in_pass:
            self._advance(g, kind)
        if self.mm.paged(g):
            if g.prefetched:
                g.prefetched = False
                if self._kept.pop(g.gid, None) is not None:
                    self.acct.count("reused_fetches")
                    self.acct.count("reused_bytes", g.nbytes)
                else:
                    self.acct.count("prefetched_fetches")
            elif g.state not in (Location.DEVICE, Location.READING, Location.TO_DEVICE):
                self.acct.count("on_demand_fetches" if (track and self.in_pass)
                                else "untracked_fetches")
                if not self.mm.fetch_async(g, allow_overflow=False):
                    self._evict_for(g)
                    self.mm.fetch_async(g, allow_overflow=True)
            self.mm.wait_resident(g)
        if track and self.in_pass and not self.divergent:
            self._prefetch_ahead()

    def release(self, g: GroupRecord) -> None:
        """Release ``g`` unless the trace needs it again within the prefetch window, in
        which case it stays resident as if prefetched (no re-read)."""
        if self.in_pass and not self.divergent and self.trace is not None and self.depth > 0:
            nxt = self._next_use(g.gid)
            if nxt is not None and nxt < self.cursor + self.depth:
                g.prefetched = True
                return
            if nxt is not None and self.mm.paged(g) and self._keep(g, nxt):
                g.prefetched = True
                return
        self.mm.release(g)

    def _keep(self, g: GroupRecord, nxt: int) -> bool:
        """Keep released ``g`` resident until its next use at trace position ``nxt``
        (Note [Reuse within a micro-step]) if it fits in ``reuse_bytes``, releasing kept
        groups needed later than ``g`` to make room."""
        if self.reuse_bytes <= 0 or g.nbytes > self.reuse_bytes or g.device_buf is None:
            return False
        need = sum(self._kept.values()) + g.nbytes - self.reuse_bytes
        if need > 0:
            later = sorted((x for x in ((self._kept_next(gid), gid) for gid in self._kept)
                            if x[0] > nxt), reverse=True)
            if sum(self._kept[gid] for _, gid in later) < need:
                return False
            for _, gid in later:
                if need <= 0:
                    break
                need -= self._drop_kept(self._by_gid[gid])
        self._kept[g.gid] = g.nbytes
        return True

    def _kept_next(self, gid: int) -> int:
        """Trace position of kept group ``gid``'s next use (none left: furthest of all)."""
        nxt = self._next_use(gid)
        return 1 << 30 if nxt is None else nxt

    def release_kept(self) -> None:
        """Release every kept group (before an optimizer step updates the homes: a forward
        whose backward has not run yet must not leave a gathered copy behind)."""
        for gid in list(self._kept):
            c = self._by_gid[gid]
            if c.users == 0:
                self._drop_kept(c)

    def _drop_kept(self, c: GroupRecord) -> int:
        """Release kept group ``c`` (its next use fetches it again); returns its bytes."""
        nbytes = self._kept.pop(c.gid, 0)
        c.prefetched = False
        self.mm.release(c)
        self.acct.count("reuse_evicted")
        return nbytes

    def _release_kept_after(self, pos: int, nbytes: int) -> bool:
        """The device budget is full: release kept groups whose next use comes after trace
        position ``pos``, furthest first, until ``nbytes`` can be leased.  Returns whether
        anything was released."""
        later = sorted(((self._kept_next(gid), gid) for gid in self._kept), reverse=True)
        freed = False
        for nxt, gid in later:
            if nxt <= pos or self.mm.device_pool.can_lease(nbytes):
                break
            c = self._by_gid[gid]
            if c.users:
                continue
            self._drop_kept(c)
            freed = True
        return freed

    def _advance(self, g: GroupRecord, kind: str) -> None:
        if kind == "unpack" and self._last_event == ("unpack", g.gid):
            return          # several saved views of one group unpacked back to back
        self._last_event = (kind, g.gid)
        self.recording.append(g.gid)
        if self.trace is None or self.divergent:
            return
        if self.cursor < len(self.trace) and self.trace[self.cursor] == g.gid:
            self.cursor += 1
            return
        self.divergent = True
        self.acct.count("divergent_steps")
        log.debug("prefetch: order diverged from the trace at position %d (group %d %r); "
                  "fetching on demand for the rest of this micro-step", self.cursor, g.gid, g.name)

    def _prefetch_ahead(self) -> None:
        if self.trace is None or self.depth <= 0:
            return
        trace = self.trace
        for i in range(self.cursor, min(len(trace), self.cursor + self.depth)):
            g = self._by_gid[trace[i]]
            if not self.mm.paged(g) or g.state in (Location.DEVICE, Location.READING,
                                                   Location.TO_DEVICE):
                continue
            if not self.mm.fetch_async(g, allow_overflow=False):
                if not (self._kept and self._release_kept_after(i, g.nbytes)
                        and self.mm.fetch_async(g, allow_overflow=False)):
                    break
            g.prefetched = True

    def _evict_for(self, g: GroupRecord) -> None:
        """Free device budget for ``g`` by dropping prefetched-but-unused groups, the one
        needed furthest in the future first."""
        def next_use(c: GroupRecord) -> int:
            nxt = None if self.divergent or self.trace is None else self._next_use(c.gid)
            return 1 << 30 if nxt is None else nxt - self.cursor
        cands = [c for c in self.mm.groups if c.prefetched and c.users == 0 and c is not g]
        for c in sorted(cands, key=next_use, reverse=True):
            if c.gid in self._kept:
                self._drop_kept(c)
            else:
                c.prefetched = False
                self.mm.release(c)
                self.acct.count("prefetch_evicted")
            if self.mm.device_pool.can_lease(g.nbytes):
                return
