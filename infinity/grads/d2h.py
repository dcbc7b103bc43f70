"""Gradients leaving a separate device tier: one D2H per group, host accumulation off the
autograd thread.

Used when the device tier is not host memory (CUDA, or the ``SimulatedDevice`` of the
tests).  :meth:`GradD2H.push` copies one parameter's gradient into its slot of the group's
flat device buffer (a device-side copy, leased from the device tier) and returns; once
every trainable parameter of the group has delivered its gradient (or at the end of
backward, :meth:`drain`) the group leaves the device in **one** D2H copy on the copy
stream into leased pinned staging.  A worker thread waits for that copy's event and hands
each arrived slot to ``sink(group, slot, host_grad)`` (the fp32 copy-or-add into the
host accumulation buffer), so neither the wait nor the fp32 adds run on the thread that
runs autograd.  The staging and device buffers go back to their pools on the calling
thread once the worker finished with them (:meth:`poll`, at every push; :meth:`drain`).

``max_inflight_bytes`` bounds the pinned staging held by copies not yet accumulated: a
group whose staging would exceed it first waits for the oldest ones.  The placement plan
counts this bound ("gradient D2H staging") and the device buffers ("gradient D2H
sources").  ``threaded=False`` runs the sink on the calling thread instead (a sink that
leases from pools, e.g. the NVMe gradient home, which are not thread-safe).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

from infinity.memory.pool import ALIGN, per_size_class, round_up

__all__ = ["GradD2H"]


class _Open:
    """A group's gradients being assembled in its device buffer."""
    __slots__ = ("group", "leased", "buf", "need", "arrived")

    def __init__(self, group, leased, span: int):
        self.group = group
        self.leased = leased               # the device tier's buffer (given back later)
        self.buf = leased[:span]
        self.need = {id(s) for s in group.slots if s.trainable}   # slots still to come
        self.arrived: list = []            # slots with a gradient in buf


class GradD2H:
    def __init__(self, device_tier, host_pool, sink, max_inflight_bytes: int | None = None,
                 *, threaded: bool = True):
        self.dev = device_tier
        self.host_pool = host_pool
        self.sink = sink
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight_bytes = 0
        self.threaded = threaded
        self._open: dict[int, _Open] = {}
        self._queue: deque = deque()     # (future | None, Transfer, group, slots, staging)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="infinity-grad-d2h") \
            if threaded else None
        # landed(group, slots): (calling thread) the slots' gradients are in the host
        # accumulation -- the overlapped step's grad_arrived (Note [Streamed gradients])
        self.landed = None

    # ------------------------------------------------------------------ API
    def push(self, g, slot, grad) -> None:
        o = self._open.get(g.gid)
        if o is None:
            span = max(s.offset + s.numel for s in g.slots if s.trainable)
            buf = self.dev.lease_or_overflow(span * grad.element_size(), grad.dtype,
                                             "a group's gradients leaving the device")
            o = self._open[g.gid] = _Open(g, buf, span)
        o.buf[slot.offset:slot.offset + slot.numel].copy_(grad.reshape(-1))
        if id(slot) in o.need:
            o.need.discard(id(slot))
            o.arrived.append(slot)
        if not o.need:
            self._flush(g.gid)
        self.poll()

    def poll(self) -> None:
        """Give back the buffers of accumulated groups (in order, never blocking)."""
        q = self._queue
        while q and self._done(q[0]):
            self._finish(q.popleft())

    def drain(self) -> None:
        """End of backward: send what is still assembled, wait for every accumulation."""
        for gid in sorted(self._open):
            self._flush(gid)
        q = self._queue
        while q:
            self._finish(q.popleft())

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)

    def staging_sizes(self, groups) -> list[int]:
        """The pinned staging the D2H copies of ``groups``' gradients lease: per size class,
        as many buffers as ``max_inflight_bytes`` lets be outstanding (at least one), to be
        reserved at ``initialize`` (see ``BufferPool.reserve``)."""
        cap = self.max_inflight_bytes
        spans = (max(s.offset + s.numel for s in g.slots if s.trainable) * g.dtype.itemsize
                 for g in groups if g.trainable)
        return per_size_class(spans, len(groups) if cap is None else
                              lambda n: max(1, cap // round_up(n, ALIGN)))

    def __len__(self) -> int:
        return len(self._queue) + len(self._open)

    # ------------------------------------------------------------------ internals
    def _flush(self, gid: int) -> None:
        """One D2H of the group's assembled gradients; the worker accumulates them."""
        o = self._open.pop(gid)
        src = o.buf
        nbytes = round_up(src.numel() * src.element_size(), ALIGN)
        cap = self.max_inflight_bytes
        q = self._queue
        while q and cap is not None and self.inflight_bytes + nbytes > cap:
            self._finish(q.popleft())       # oldest first
        staging = self.host_pool.lease(src.numel() * src.element_size(), src.dtype)
        x = self.dev.d2h(staging, src)
        fut = self._worker.submit(self._accumulate, x, o.group, o.arrived, staging) \
            if self._worker is not None else None
        q.append((fut, x, o, staging))
        self.inflight_bytes += nbytes

    def _accumulate(self, x, g, slots, staging) -> None:
        """The copy's event, then the fp32 copy-or-add of each arrived slot (worker)."""
        x.wait_host()
        for s in slots:
            self.sink(g, s, staging[s.offset:s.offset + s.numel].view(s.shape))

    @staticmethod
    def _done(item) -> bool:
        fut, x = item[0], item[1]
        return fut.done() if fut is not None else x.ready()

    def _finish(self, item) -> None:
        fut, x, o, staging = item
        try:
            if fut is not None:
                fut.result()                  # re-raises the sink's error here
            else:
                self._accumulate(x, o.group, o.arrived, staging)
        finally:
            self._release(x, staging, o)
        if self.landed is not None:
            self.landed(o.group, o.arrived)

    def _release(self, x, staging, o) -> None:
        try:
            x.wait_host()                     # (done already unless the sink raised)
            self.inflight_bytes -= round_up(x.nbytes, ALIGN)
            self.dev.acct.link("d2h", x.nbytes, x.seconds())
            self.host_pool.give_back(staging)
            self.dev.give_back(o.leased)      # the copy has read it: compute may reuse it
        finally:
            x.src = None
