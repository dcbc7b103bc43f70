"""Gradients leaving a separate device tier: D2H on the copy stream, then host accumulation.

Used when the device tier is not host memory (CUDA, or the ``SimulatedDevice`` of the
tests).  :meth:`GradD2H.push` issues the copy of one parameter's gradient into a leased
pinned host buffer (``Transfer`` with an event) and returns at once; completed copies are
handed to ``sink(group, slot, host_grad)`` (the fp32 accumulation) strictly in the order
they were pushed, and the staging buffer goes back to the host pool only after the sink
consumed it.  :meth:`drain` (end of backward) waits for the rest.
"""
from __future__ import annotations

from collections import deque

__all__ = ["GradD2H"]


class GradD2H:
    def __init__(self, device_tier, host_pool, sink):
        self.dev = device_tier
        self.host_pool = host_pool
        self.sink = sink
        self._queue: deque = deque()          # (Transfer, group, slot, staging)

    def push(self, g, slot, grad) -> None:
        flat = grad.reshape(-1)
        staging = self.host_pool.lease(flat.numel() * flat.element_size(), flat.dtype)
        self._queue.append((self.dev.d2h(staging, flat), g, slot, staging))
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
        try:
            self.sink(g, slot, staging)
        finally:
            self.host_pool.give_back(staging)
        x.src = None                           # the device gradient may go now

    def __len__(self) -> int:
        return len(self._queue)
