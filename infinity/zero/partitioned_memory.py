"""ZeRO stage 3: each rank homes only its shard of every parameter group.

:class:`PartitionedMemoryManager` keeps the interface of
:class:`infinity.memory.manager.MemoryManager` (``place``, ``fetch_async``,
``wait_resident``, ``release``, ``paged``, ``group_of_storage``), so the hooks and the
prefetch coordinator drive it unchanged:

* ``place``: the group's flat values are assembled once in a staging buffer and only
  this rank's shard ``[lo, hi)`` is kept at the home: a host buffer (``"cpu"``; a
  ``"device"`` home is host memory too on a CPU-only machine, leased from the device
  tier's pool) or a shard-sized NVMe extent in this rank's own swap directory.
* ``fetch_async``: leases a full-size buffer on the device tier and hands the fetch to a
  single worker thread that (NVMe home) reads the shard straight into its slot of that
  buffer and then all-gathers the other ranks' shards into it.  Because the prefetch
  coordinator calls ``fetch_async`` ``depth`` groups ahead, the reads and all-gathers of
  the next groups overlap the compute of the current one.  All parameter all-gathers are
  issued by that one thread on the ``param`` process group, in ``fetch_async`` order,
  which is the same on every rank (same model, same trace, same budgets).
* ``release``: returns the full buffer; the shard at home is the current value (the
  optimizer updates it in place), so nothing is written back.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.memory.manager import MemoryManager
from infinity.memory.record import GroupRecord, Location
from infinity.zero.comm import Comm
from infinity.zero.partition import Partition

log = logging.getLogger("infinity.zero")

__all__ = ["PartitionedMemoryManager"]


class PartitionedMemoryManager(MemoryManager):
    def __init__(self, groups: list[GroupRecord], *, comm: Comm, **kw):
        super().__init__(groups, **kw)
        self.comm = comm
        self.part = Partition(comm.rank, comm.world_size)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"infinity-gather-r{comm.rank}")
        self._shard_pool: dict[int, object] = {}    # gid -> pool the home shard came from
        for g in groups:
            if g.home == "device":
                # the shard lives in the device tier's memory, but the group is paged
                # (gathered before use); on CPU that memory is host memory
                g.home = "cpu"
                self._shard_pool[g.gid] = self.device_pool
            elif g.home == "cpu":
                self._shard_pool[g.gid] = self.host_pool

    def shard(self, g: GroupRecord) -> tuple[int, int]:
        return self.part.range(g.padded_numel)

    # ------------------------------------------------------------------ setup
    def place(self, g: GroupRecord, staging: torch.Tensor | None = None) -> None:
        lo, hi = self.shard(g)
        esize = torch.empty((), dtype=g.dtype).element_size()
        shard_bytes = (hi - lo) * esize
        own = staging is None or staging.numel() < g.nbytes
        full = self.host_pool.lease(g.nbytes, g.dtype) if own else \
            staging.view(g.dtype)[: g.padded_numel]
        try:
            self._fill(g, full)
            if g.home == "cpu":
                pool = self._shard_pool[g.gid]
                g.host_buf = pool.lease(shard_bytes, g.dtype)
                g.host_buf.copy_(full[lo:hi])
            elif g.home == "nvme":
                if self.swap is None:
                    raise RuntimeError("memory: NVMe home requested but no swap space was opened")
                g.extent = self.swap.allocate(shard_bytes)
                t0 = time.perf_counter()
                self.swap.write(g.extent, full[lo:hi]).wait()
                self._link("nvme_write", shard_bytes, t0)
            else:
                raise ValueError(f"memory: unknown home {g.home!r}")
        finally:
            if own:
                self.host_pool.give_back(full)
        g.set_home_state()

    # ------------------------------------------------------------------ fetch
    def paged(self, g: GroupRecord) -> bool:
        return True

    def fetch_async(self, g: GroupRecord, *, allow_overflow: bool) -> bool:
        if g.state in (Location.DEVICE, Location.READING, Location.TO_DEVICE):
            return True
        buf = self._lease_device(g, allow_overflow)
        if buf is None:
            return False
        t0 = time.perf_counter()
        fut = self._worker.submit(self._gather, g, buf)
        if g.home == "nvme":
            g.begin_read(buf, (fut, t0))
        else:
            g.begin_to_device(buf, (fut, t0))
        return True

    def _gather(self, g: GroupRecord, buf: torch.Tensor) -> None:
        """Worker thread: shard from home into its slot of ``buf``, then all-gather."""
        lo, hi = self.shard(g)
        mine = buf[lo:hi]
        if g.home == "nvme":
            t0 = time.perf_counter()
            self.swap.read(g.extent, mine).wait()
            self._link("nvme_read", mine.numel() * mine.element_size(), t0)
        else:
            mine.copy_(g.host_buf)
        self.comm.all_gather_into(buf, mine.clone(), group="param",
                                  name=f"parameters of group {g.gid} ({g.name or '<root>'})")

    def wait_resident(self, g: GroupRecord) -> None:
        if g.state in (Location.READING, Location.TO_DEVICE):
            fut, _t0 = g.pending
            fut.result()        # re-raises the worker's AioError / CollectiveError
            if g.state is Location.READING:
                g.finish_read()
            else:
                g.finish_to_device()
            self._by_storage[g.device_buf.untyped_storage().data_ptr()] = g
        elif g.state is not Location.DEVICE:
            raise RuntimeError(f"memory: group {g.gid} ({g.name}) was not fetched "
                               f"(state {g.state.name})")

    def release(self, g: GroupRecord) -> None:
        if g.state in (Location.NVME, Location.HOST):
            return
        if g.state in (Location.READING, Location.TO_DEVICE):
            self.wait_resident(g)
        buf = g.device_buf
        self._by_storage.pop(buf.untyped_storage().data_ptr(), None)
        g.release()
        self.device_pool.give_back(buf)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self.closed:
            return
        for g in self.groups:
            if g.state in (Location.READING, Location.TO_DEVICE) and g.pending is not None:
                try:
                    g.pending[0].result()
                except Exception:  # the close path must not mask the original error
                    log.debug("memory: pending gather of group %d failed during close", g.gid)
        self._worker.shutdown(wait=True)
        self.closed = True
        self.device_pool.close()
