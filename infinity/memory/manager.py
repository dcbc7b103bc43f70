"""The tiered memory manager for parameter groups: homes, fetch, release, budgets.

It owns the :class:`~infinity.memory.record.GroupRecord` objects and moves them
between their home (device / host / NVMe) and the device tier.  On a CPU-only
machine the device tier is host memory bounded by ``device_memory_gb``; an
NVMe-homed group is read *straight into* the buffer compute uses (no staging copy),
a host-homed group is used in place (the host buffer *is* device-addressable).

Who calls what: the hooks (``infinity.zero.hooks``) call :meth:`use`/:meth:`done_with`
through the prefetch coordinator, which calls :meth:`fetch_async` ahead of time.
"""
from __future__ import annotations

import logging
import time

import torch

from .accounting import Accounting
from .pool import BufferPool, PoolExhausted
from .record import GroupRecord, Location

log = logging.getLogger("infinity.memory")

__all__ = ["MemoryManager"]


class MemoryManager:
    def __init__(self, groups: list[GroupRecord], *, device: torch.device,
                 device_budget: int | None, host_pool: BufferPool, swap=None,
                 accounting: Accounting, timeline=None):
        self.groups = groups
        self.device = device
        self.acct = accounting
        self.timeline = timeline
        self.swap = swap
        self.host_pool = host_pool
        self.device_pool = BufferPool("device", device_budget, accounting)
        self._by_storage: dict[int, GroupRecord] = {}
        self._overflow_warned = False
        self.closed = False

    # ------------------------------------------------------------------ setup
    def place(self, g: GroupRecord, staging: torch.Tensor | None = None) -> None:
        """Create ``g``'s home from the parameters' current values (called once)."""
        if g.home == "device":
            buf = self._alloc_resident(g)
            self._fill(g, buf)
            g.make_resident(buf)
            return
        if g.home == "cpu":
            g.host_buf = self.host_pool.lease(g.nbytes, g.dtype)
            self._fill(g, g.host_buf)
            g.set_home_state()
            return
        if g.home == "nvme":
            if self.swap is None:
                raise RuntimeError("memory: NVMe home requested but no swap space was opened")
            g.extent = self.swap.allocate(g.nbytes)
            buf = staging.view(g.dtype)[: g.padded_numel] if staging is not None else \
                self.host_pool.lease(g.nbytes, g.dtype)
            self._fill(g, buf)
            t0 = time.perf_counter()
            self.swap.write(g.extent, buf).wait()
            self._link("nvme_write", g.nbytes, t0)
            if staging is None:
                self.host_pool.give_back(buf)
            g.set_home_state()
            return
        raise ValueError(f"memory: unknown home {g.home!r}")

    def _alloc_resident(self, g: GroupRecord) -> torch.Tensor:
        buf = self.device_pool.lease(g.nbytes, g.dtype) if self.device.type == "cpu" else \
            torch.empty(g.padded_numel, dtype=g.dtype, device=self.device)
        if self.device.type != "cpu":
            self.acct.alloc("device", g.nbytes)
        return buf

    @staticmethod
    def _fill(g: GroupRecord, buf: torch.Tensor) -> None:
        buf.zero_()
        with torch.no_grad():
            for s in g.slots:
                buf[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))

    # ------------------------------------------------------------------ fetch
    def fetch_async(self, g: GroupRecord, *, allow_overflow: bool) -> bool:
        """Start bringing ``g`` to the device tier. Returns False when the budget is full
        (only possible with ``allow_overflow=False``)."""
        if g.state in (Location.DEVICE, Location.READING, Location.TO_DEVICE):
            return True
        if g.home == "cpu" and self.device.type == "cpu":
            # the host home is directly usable by CPU compute: no copy, no extra bytes
            g.begin_to_device(g.host_buf)
            g.finish_to_device()
            # saved tensors must still be packed as references: autograd keeps the leaf
            # parameter itself, whose .data is swapped out on release
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g
            return True
        if g.home == "cpu":
            raise NotImplementedError("memory: CUDA device tier is not implemented yet "
                                      "(host-homed params on a GPU)")
        # NVMe home
        if not self.device_pool.can_lease(g.nbytes):
            if not allow_overflow:
                return False
            if not self._overflow_warned:
                log.warning("device tier: budget %s bytes too small for the working set; "
                            "exceeding it to make progress (raise offload.device_memory_gb)",
                            self.device_pool.budget)
                self._overflow_warned = True
            self.acct.count("device_budget_overflows")
            budget, self.device_pool.budget = self.device_pool.budget, None
            try:
                buf = self.device_pool.lease(g.nbytes, g.dtype)
            finally:
                self.device_pool.budget = budget
        else:
            buf = self.device_pool.lease(g.nbytes, g.dtype)
        if self.device.type != "cpu":
            raise NotImplementedError("memory: CUDA device tier is not implemented yet "
                                      "(NVMe-homed params on a GPU)")
        t0 = time.perf_counter()
        handle = self.swap.read(g.extent, buf)
        g.begin_read(buf, (handle, t0))
        return True

    def wait_resident(self, g: GroupRecord) -> None:
        """Block until ``g`` is on the device tier (it must have been fetched)."""
        if g.state is Location.READING:
            handle, t0 = g.pending
            if not handle.done() and self.timeline is not None and self.timeline.enabled:
                with self.timeline.span("wait", f"fetch {g.name or '<root>'}", g.nbytes):
                    handle.wait()
            else:
                handle.wait()
            self._link("nvme_read", g.nbytes, t0)
            g.finish_read()
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g
        elif g.state is Location.TO_DEVICE:
            g.finish_to_device()
        elif g.state is not Location.DEVICE:
            raise RuntimeError(f"memory: group {g.gid} ({g.name}) was not fetched "
                               f"(state {g.state.name})")

    def release(self, g: GroupRecord) -> None:
        """Drop ``g``'s device copy (its home copy stays current)."""
        if g.home == "device" or g.state is Location.NVME or g.state is Location.HOST:
            return
        if g.state is Location.READING:
            self.wait_resident(g)
        if g.state is Location.TO_DEVICE:
            g.finish_to_device()
        buf = g.device_buf
        self._by_storage.pop(buf.untyped_storage().data_ptr(), None)
        g.release()
        if g.home == "nvme":
            self.device_pool.give_back(buf)

    def group_of_storage(self, ptr: int) -> GroupRecord | None:
        return self._by_storage.get(ptr)

    def paged(self, g: GroupRecord) -> bool:
        return g.home != "device"

    # ------------------------------------------------------------------ accounting
    def _link(self, name: str, nbytes: int, t0: float) -> None:
        t1 = time.perf_counter()
        self.acct.link(name, nbytes, t1 - t0)
        tl = self.timeline
        if tl is not None and getattr(tl, "enabled", False):
            tl.add(name, "params", t0, t1, nbytes)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g in self.groups:
            if g.state is Location.READING:
                try:
                    g.pending[0].wait()
                except Exception:  # the close path must not mask the original error
                    log.debug("memory: pending read of group %d failed during close", g.gid)
        self.device_pool.close()
