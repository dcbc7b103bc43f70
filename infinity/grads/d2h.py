"""Gradients leaving a separate device tier: D2H on the copy stream, then host accumulation.

Used when the device tier is not host memory (CUDA, or the ``SimulatedDevice`` of the
tests).  :meth:`GradD2H.push` issues the copy of one parameter's gradient into a leased
pinned host buffer (``Transfer`` with an event) and returns at once; completed copies are
handed to ``sink(group, slot, host_grad)`` (the fp32 accumulation) strictly in the order
they were pushed, and the staging buffer goes back to the host pool only after the sink
consumed it.  :meth:`drain` (end of backward) waits for the rest.

``max_inflight_bytes`` bounds the pinned staging held by copies not yet consumed (the
host can run far ahead of the GPU in backward): a push that would exceed it first waits
for the oldest copies.  The placement plan counts this bound ("gradient D2H staging").
"""
from __future__ import annotations

from collections import deque

from infinity.memory.pool import ALIGN, round_up

__all__ = ["GradD2H"]


class GradD2H:
    def __init__(self, device_tier, host_pool, sink, max_inflight_bytes: int | None = None):
        self.dev = device_tier
        self.host_pool = host_pool
        self.sink = sink
        self.max_inflight_bytes = max_inflight_bytes
        self.inflight_bytes = 0
        self._queue: deque = deque()          # (Transfer, group, slot, staging)

    def push(self, g, slot, grad) -> None:
        flat = grad.reshape(-1)
        exact = flat.numel() * flat.element_size()
        nbytes = round_up(exact, ALIGN)        # what the pool holds for it
        cap = self.max_inflight_bytes
        q = self._queue
        while q and cap is not None and self.inflight_bytes + nbytes > cap:
            item = q.popleft()                 # oldest first: sink order is push order
            item[0].wait_host()
            self._consume(item)
        staging = self.host_pool.lease(exact, flat.dtype)
        q.append((self.dev.d2h(staging, flat), g, slot, staging))
        self.inflight_bytes += nbytes
        self.poll()

    def poll(self) -> None:
        """Hand completed copies to the sink (in push order, never blocking)."""
        q = self._queue
        while q and q[0][0].ready():
            self._consume(q.popleft())

    def drain(self) -> None:
        q = self._queue
        while q:
            item = q.popleft()
            item[0].wait_host()
            self._consume(item)

    def _consume(self, item) -> None:
        x, g, slot, staging = item
        self.inflight_bytes -= round_up(x.nbytes, ALIGN)
        self.dev.acct.link("d2h", x.nbytes, x.seconds())
        try:
            self.sink(g, slot, staging)
        finally:
            self.host_pool.give_back(staging)
        x.src = None                           # the device gradient may go now

    def __len__(self) -> int:
        return len(self._queue)
